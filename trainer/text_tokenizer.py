"""The tokenizer that turns text into training tokens, loaded the ways the field keeps them.

A Hugging Face tokenizer is named by:
  * a `tokenizer.json` file (what `tokenizers` saves; GPT-2's byte-level BPE among them);
  * a folder holding `tokenizer.json`, or GPT-2's original pair `vocab.json` + `merges.txt`;
  * a hub name (e.g. "gpt2"), resolved by `transformers`: `encode` may download it; everywhere
    else (job validation, workers, export) only the local Hugging Face cache is read, so a job
    never waits on the network or loads something other than what its data was made with.
"bytes" is the byte-level tokenizer (vocab 256) without any file.

Why one wrapper: `encode` and `ds3dctl export --format hf` need the same three things from any of
these: token ids of a text, the vocabulary size (which picks the token dtype and must fit the
model) and the end-of-document id that separates documents, plus a way to write the tokenizer
next to an exported model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .errors import ConfigError

BYTES = "bytes"
# transformers' model_max_length when a tokenizer states none (VERY_LARGE_INTEGER, 1e30)
_UNSTATED_LENGTH = int(1e29)
# end-of-document tokens of common tokenizers, tried in order when none is named
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class TextTokenizer:
    """Token ids of text, vocabulary size and end-of-document id of one tokenizer."""

    def __init__(self, spec: str, eod_token: str | None = None, download: bool = False) -> None:
        self.spec, self.download = spec, download
        self._hf: Any = None   # tokenizers.Tokenizer
        self._auto: Any = None  # transformers tokenizer (hub names)
        self._folder: Path | None = None  # the folder it came from (its transformers settings)
        if spec != BYTES:
            self._load(spec)
        self.eod_id = self._find_eod(eod_token)

    def _load(self, spec: str) -> None:
        path = Path(spec)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("reading a Hugging Face tokenizer needs the `tokenizers` package: "
                              "pip install tokenizers") from None
        if path.is_file():
            self._hf = _tokenizer_from_file(Tokenizer, path)
            self._folder = path.parent if path.name == "tokenizer.json" else None
        elif path.is_dir():
            self._folder = path
            if (path / "tokenizer.json").is_file():
                self._hf = _tokenizer_from_file(Tokenizer, path / "tokenizer.json")
            elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
                self._hf = _gpt2_pair(path / "vocab.json", path / "merges.txt")
            else:
                raise ConfigError(f"{path} holds neither tokenizer.json nor vocab.json + "
                                  "merges.txt; give a tokenizer file or folder")
        elif "/" in spec and (spec.startswith(("/", ".")) or path.suffix):
            raise ConfigError(f"tokenizer {spec!r} does not exist")
        else:
            self._auto = _from_hub(spec, self.download)

    def _find_eod(self, eod_token: str | None) -> int | None:
        if self.spec == BYTES:
            if eod_token is not None:
                raise ConfigError("the byte-level tokenizer has no special tokens; leave "
                                  "--eod-token unset")
            return None
        names = [eod_token] if eod_token is not None else list(EOD_CANDIDATES)
        if self._auto is not None and eod_token is None and self._auto.eos_token_id is not None:
            return int(self._auto.eos_token_id)
        for name in names:
            tid = self._token_to_id(name)
            if tid is not None:
                return tid
        if eod_token is not None:
            raise ConfigError(f"end-of-document token {eod_token!r} is not in the vocabulary of "
                              f"{self.spec}")
        return None

    def _token_to_id(self, token: str) -> int | None:
        if self._auto is not None:
            tid = self._auto.convert_tokens_to_ids(token)
            return None if tid is None or tid == self._auto.unk_token_id else int(tid)
        tid = self._hf.token_to_id(token)
        return None if tid is None else int(tid)

    @property
    def vocab_size(self) -> int:
        if self.spec == BYTES:
            return 256
        if self._auto is not None:
            return len(self._auto)
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        if self.spec == BYTES:
            return list(text.encode("utf-8"))
        if self._auto is not None:
            return list(self._auto.encode(text, add_special_tokens=False))
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def save_for_transformers(self, out: Path, model_max_length: int | None = None) -> list[str]:
        """Writes the files `transformers.AutoTokenizer.from_pretrained(out)` loads; returns
        the names of all it wrote (none for the byte-level tokenizer, which transformers does
        not know). A transformers folder's own tokenizer_config.json (pad token, padding side,
        special tokens) and special_tokens_map.json are kept; otherwise the settings name the
        end-of-document token as bos/eos and an unknown token only when the tokenizer's model
        has one (GPT-2's byte-level BPE has none: an invented one replaced a real <unk>).
        `model_max_length` (the model's seq_len) is written where the source states none."""
        if self.spec == BYTES:
            return []
        if self._auto is not None:
            if model_max_length is not None and self._auto.model_max_length >= _UNSTATED_LENGTH:
                self._auto.model_max_length = model_max_length
            saved = self._auto.save_pretrained(str(out))
            return sorted({Path(f).name for f in saved if Path(f).is_file()})
        out.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(out / "tokenizer.json"))
        files = ["tokenizer.json", "tokenizer_config.json"]
        settings = self._folder_settings()
        eod = self._hf.id_to_token(self.eod_id) if self.eod_id is not None else None
        if settings is None:  # what PreTrainedTokenizerFast.save_pretrained writes
            settings = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "clean_up_tokenization_spaces": False}
            if eod is not None:
                settings.update(bos_token=eod, eos_token=eod)
            unk = getattr(self._hf.model, "unk_token", None)
            if isinstance(unk, str) and self._hf.token_to_id(unk) is not None:
                settings["unk_token"] = unk
        elif eod is not None:
            settings.setdefault("eos_token", eod)
        if settings.get("model_max_length") is None and model_max_length is not None:
            settings["model_max_length"] = model_max_length
        (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        special = self._folder / "special_tokens_map.json" if self._folder else None
        if special is not None and special.is_file():
            shutil.copyfile(special, out / special.name)
            files.append(special.name)
        return sorted(files)

    def _folder_settings(self) -> dict[str, Any] | None:
        """The tokenizer_config.json of the folder the tokenizer came from, if any."""
        path = self._folder / "tokenizer_config.json" if self._folder else None
        if path is None or not path.is_file():
            return None
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path} cannot be read as JSON ({e}); fix it or give the "
                              "tokenizer.json alone in another folder") from None
        if not isinstance(settings, dict):
            raise ConfigError(f"{path} is not a JSON object of tokenizer settings")
        return settings


def _tokenizer_from_file(cls: Any, path: Path) -> Any:
    try:
        return cls.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise ConfigError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None


def _gpt2_pair(vocab: Path, merges: Path) -> Any:
    """GPT-2's original files: a byte-level BPE with <|endoftext|> as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        bpe = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise ConfigError(f"{vocab} + {merges} are not a GPT-2 vocabulary/merges pair ({e})") \
            from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if "<|endoftext|>" in json.loads(vocab.read_text()):
        tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _from_hub(name: str, download: bool) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"tokenizer {name!r} is neither a file nor a folder here; loading it by "
                          "name needs `transformers` (pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=not download)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if download else " from the local Hugging Face cache"
        raise ConfigError(f"tokenizer {name!r} could not be loaded by name{where} ({first}); "
                          "give the path of a tokenizer.json file or a tokenizer folder") \
            from None
