"""Generated gRPC/protobuf modules of the ds3d v1 API (`control_pb2`, `control_pb2_grpc`).

The `.proto` next to this file is the source of truth; the modules are written by the build
(`setup.py`'s `build_py` runs grpc_tools.protoc) and are never edited or committed.
"""
