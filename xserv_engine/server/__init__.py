"""The gRPC edge of the engine: protobuf conversion, status mapping, servicer, server process."""
