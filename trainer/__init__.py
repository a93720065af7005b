"""ds3d's data plane: the GPT, its 3D-parallel layout on DeepSpeed, the data order, the step loop
and what workers report (see docs/architecture.md). `config.py` is also imported by ds3dctl and
ds3dd, so this package's __init__ imports nothing heavy."""
