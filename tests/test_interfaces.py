"""spice_megatron/loop/interfaces.py: both drivers and the fleet keep to the Protocols the loop is typed
against (every method, its parameters in order, anything more with a default)."""
from __future__ import annotations

import inspect

import pytest

from spice_megatron.loop.driver import Driver
from spice_megatron.loop.driver_process import DriverProcess
from spice_megatron.loop.interfaces import EngineFleet, RolloutDriver
from spice_megatron.rollout.fleet import RolloutFleet


def _members(protocol) -> dict:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}


@pytest.mark.parametrize("implementation,protocol", [(Driver, RolloutDriver), (DriverProcess, RolloutDriver),
                                                     (RolloutFleet, EngineFleet)])
def test_the_implementation_keeps_to_the_protocol(implementation, protocol):
    members = _members(protocol)
    assert len(members) >= 9
    for name, declared in members.items():
        given = getattr(implementation, name, None)
        assert given is not None, f"{implementation.__name__} has no {name}"
        if isinstance(declared, property):
            assert isinstance(given, property), f"{implementation.__name__}.{name} is not a property"
            continue
        wanted = list(inspect.signature(declared).parameters.values())
        have = list(inspect.signature(given).parameters.values())
        assert [p.name for p in have[:len(wanted)]] == [p.name for p in wanted], (implementation, name)
        assert all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in have[len(wanted):]), f"{implementation.__name__}.{name}: a parameter more without default"
    for attribute in getattr(protocol, "__annotations__", {}):  # e.g. the driver's fleet, set in __init__
        assert f"self.{attribute} =" in inspect.getsource(implementation.__init__), (implementation, attribute)
