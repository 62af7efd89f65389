"""The engine's start-up plan: made once from the config by the entry point, then passed down to
the server's pinning, the core's spec and (pickled) the core process, never made again."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest

from tito_engine import server, startup_plan
from tito_engine.config import EngineConfig
from tito_engine.limits import SchedulerLimits
from tito_engine.startup_plan import StartupPlan, plan_startup


def refuse_to_plan(*args, **kwargs):
    pytest.fail("the start-up plan was made again")


def test_the_core_gets_the_cpus_of_the_plan_the_server_pinned_itself_by(tiny_text_model, monkeypatch):
    config = EngineConfig(device="cpu", model=str(tiny_text_model))
    monkeypatch.setattr("tito.cpu_affinity.allowed_cpus", lambda: frozenset({0, 1}))
    plan = plan_startup(config)
    assert (plan.cpus.core_cpus, plan.cpus.server_cpus, plan.cpus.threads) == ({1}, {0}, 1)
    # Once the server runs on its share, this process may use CPU 0 only: a plan made now would differ.
    monkeypatch.setattr("tito.cpu_affinity.allowed_cpus", lambda: frozenset({0}))
    monkeypatch.setattr(startup_plan, "plan_cpus", refuse_to_plan)
    spec = plan.core_spec(config)
    assert spec.cpu_plan is plan.cpus and spec.limits is plan.limits
    in_the_child = pickle.loads(pickle.dumps(spec))  # how the spec reaches the core process
    assert (in_the_child.cpus, in_the_child.cpu_plan) == ({1}, plan.cpus)


def test_serve_makes_the_plan_once_and_hands_it_to_the_server(monkeypatch):
    made: list[StartupPlan] = []
    given: list[StartupPlan | None] = []

    def plan_once(config: EngineConfig) -> StartupPlan:
        made.append(StartupPlan(model_dir=Path(config.model), cpus=None, limits=SchedulerLimits()))
        return made[-1]

    async def create_server(config, phases=None, plan=None):
        given.append(plan)

    async def run_until_signal(running):
        return None

    monkeypatch.setattr(server, "plan_startup", plan_once)
    monkeypatch.setattr(server, "create_server", create_server)
    monkeypatch.setattr(server, "run_until_signal", run_until_signal)
    asyncio.run(server.serve(EngineConfig(model="m")))
    assert len(made) == 1 and given == made


def test_a_backend_built_from_a_plan_plans_nothing_again(monkeypatch):
    plan = StartupPlan(model_dir=Path("/models/m"), cpus=None, limits=SchedulerLimits(max_prefill_tokens=96))
    monkeypatch.setattr(server, "plan_startup", refuse_to_plan)
    monkeypatch.setattr(startup_plan, "plan_cpus", refuse_to_plan)
    monkeypatch.setattr(server.Engine, "in_process", classmethod(lambda cls, spec, **options: spec))
    spec = server._build_backend(EngineConfig(model="m", device="cpu"), plan)
    assert (spec.model_dir, spec.limits, spec.cpu_plan) == ("/models/m", plan.limits, None)
