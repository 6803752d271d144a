"""dsv41's gRPC API: ``generate.proto`` and the modules protoc generated from it.

Owns the wire messages and the service stub / servicer registration of
``dsv41.GenerateService``; regenerate with the command in ``generate.proto``'s header.
Must not import anything of the project (the generated modules import only grpc and
protobuf).
"""
