"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the gateway runs with ``--enable-runtime-lora-updating`` (vLLM
guards them with an environment switch; mlxd takes a flag). The engine does
the work between two steps and answers with the adapters it serves after it,
which every gateway then lists in ``/v1/models``. The bodies and the plain
text answers are vLLM's. A key limited to some adapters (``mlxd keys add --loras``)
may load and unload those names only (403 for others).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from mlxd.gateway.state import GatewayState, decode_body
from mlxd.shared.errors import ForbiddenError, InvalidRequestError


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def _allowed(request: Request) -> tuple[GatewayState, str | None]:
    router = request.app.state.gw
    app = router.check_auth(request)
    # vLLM's body names no base model: the adapter goes to the first engine serving LoRA.
    gw: GatewayState = next((e for e in router.engines if e.client.info is not None and e.client.info.enable_lora),
                            router.default)
    if not gw.config.enable_runtime_lora_updating:
        raise ForbiddenError("loading and unloading LoRA adapters at runtime is off; start the server with "
                             "--enable-runtime-lora-updating")
    gw.require_ready()
    if not gw.client.info.enable_lora:
        raise InvalidRequestError("LoRA adapters are off: start the engine with --enable-lora", param="lora_name")
    return gw, app


def _check_name(gw: GatewayState, app: str | None, name: str) -> None:
    """Loading or unloading changes what every app is served: a key limited to some adapters touches those only."""
    allowed = gw.keys.loras_of(app)
    if allowed is not None and name not in allowed:
        raise ForbiddenError(f"this API key may not load or unload the LoRA adapter {name!r}")


async def load_lora_adapter(request: Request) -> Response:
    gw, app = _allowed(request)
    req = await decode_body(request, LoadLoraAdapterRequest)
    _check_name(gw, app, req.lora_name)
    if req.load_inplace:
        # Replacing an adapter under a running request's feet would change its outputs midway.
        raise InvalidRequestError("load_inplace is not supported: unload the adapter, then load it again",
                                  param="load_inplace")
    await gw.client.update_lora("load", req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    gw, app = _allowed(request)
    req = await decode_body(request, UnloadLoraAdapterRequest)
    _check_name(gw, app, req.lora_name)
    await gw.client.update_lora("unload", req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
