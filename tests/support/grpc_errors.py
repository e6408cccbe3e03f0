"""Reads the typed details a gRPC error carries, as a Python client would (grpcio-status)."""

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def details_of(error: grpc.RpcError, kind):
    """The details of type `kind` (e.g. error_details_pb2.BadRequest) in the error's status."""
    status = rpc_status.from_call(error)
    found = []
    for detail in status.details if status is not None else ():
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            found.append(message)
    return found


def bad_fields(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) of every google.rpc.BadRequest field violation in the error."""
    return [(v.field, v.description) for bad in details_of(error, error_details_pb2.BadRequest)
            for v in bad.field_violations]
