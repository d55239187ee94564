"""The access-logged engine client takes every input the engine client takes."""

from __future__ import annotations

import inspect

from mlxd.gateway.access_log import AccessLoggedClient
from mlxd.gateway.engine_client import EngineClient


def test_the_access_logged_client_accepts_every_argument_of_the_engine_clients_add():
    base = inspect.signature(EngineClient.add)
    tapped = inspect.signature(AccessLoggedClient.add)
    positional = [n for n, p in base.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    tapped.bind(*positional)  # all of them by position, as the pooled routes send them
    tapped.bind(*positional[:5], **{n: n for n in positional[5:]})  # and by name, as a chat run sends images
