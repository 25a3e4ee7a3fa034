"""The `rlfabric.v1.Tool` servicer: protos in, `ToolHost` calls out, nothing else."""

from __future__ import annotations

import math

import grpc

from rlfabric.v1 import tool_pb2, tool_pb2_grpc
from services.common.credentials import guarded
from services.common.status import abort, echo
from services.tools.host import MAX_DEADLINE_S, ToolHost, UnknownToolError

SERVICE_NAME = "rlfabric.v1.Tool"
# Guarded by the token (services/common/credentials.py): a call runs code or reaches the network on the
# caller's behalf. ListTools only reads.
AUTH_METHODS = guarded(SERVICE_NAME)
# Seconds kept from the rpc's own deadline, so that a TIMEOUT answer still reaches the caller in time.
_RPC_MARGIN_S = 0.1

_STATUS = {
    "OK": tool_pb2.TOOL_CALL_STATUS_OK,
    "TOOL_ERROR": tool_pb2.TOOL_CALL_STATUS_TOOL_ERROR,
    "TIMEOUT": tool_pb2.TOOL_CALL_STATUS_TIMEOUT,
    "INVALID_ARGUMENTS": tool_pb2.TOOL_CALL_STATUS_INVALID_ARGUMENTS,
}


class ToolServicer(tool_pb2_grpc.ToolServicer):
    """Serves the tools of one `ToolHost`."""

    def __init__(self, host: ToolHost) -> None:
        self._host = host

    def ListTools(self, request: tool_pb2.ListToolsRequest, context: grpc.ServicerContext) -> tool_pb2.ListToolsResponse:
        reply = tool_pb2.ListToolsResponse(server_id=self._host.server_id)
        for tool in self._host.tools.values():
            reply.tools.add(name=tool.name, description=tool.entry.description, schema_json=tool.schema_json,
                            implementation=tool.entry.class_name, max_concurrency=tool.max_concurrency,
                            default_deadline_s=tool.default_deadline_s)
        return reply

    def Call(self, request: tool_pb2.ToolCallRequest, context: grpc.ServicerContext) -> tool_pb2.ToolCallResponse:
        if not request.name:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "ToolCallRequest.name is empty")
        if not math.isfinite(request.deadline_s) or not 0 <= request.deadline_s <= MAX_DEADLINE_S:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"ToolCallRequest.deadline_s must be finite and in [0, {MAX_DEADLINE_S:g}], got {request.deadline_s}")
        deadline_s = request.deadline_s
        rpc_left = context.time_remaining()
        if rpc_left is not None:
            tool = self._host.tools.get(request.name)
            own = deadline_s or (tool.default_deadline_s if tool is not None else MAX_DEADLINE_S)
            deadline_s = max(0.001, min(own, rpc_left - _RPC_MARGIN_S))
        try:
            result = self._host.call(request.name, request.arguments_json, deadline_s, request.call_id)
        except UnknownToolError as e:
            abort(context, grpc.StatusCode.NOT_FOUND, f"{echo(request.name)}: {e.args[0]}")
        return tool_pb2.ToolCallResponse(call_id=request.call_id, status=_STATUS[result.status.value],
                                         text=result.text, latency_s=result.latency_s, error=result.error,
                                         server_id=self._host.server_id)
