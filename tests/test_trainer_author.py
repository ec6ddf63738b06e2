"""A trainer plugin from the guide alone.

The example trainer of ``docs/plugins.md`` (``laminar-hftrain``) is extracted as written,
installed as a distribution (a ``dist-info`` on ``sys.path``, so its entry point is found like
a pip install's) and passes the trainer kit through its own test; the kit fails the same
engine when it trains on what a loss mask excludes, and core names the fix when a hook
returns per-position log-probs. The kit's checks are explicit raises, so ``python -O``
keeps them.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_author import _FILE_BLOCK, _dist, guide_section  # the guide's extraction

import laminar_core.testing.trainer as trainer_kit
from laminar_core import build_tiny_model, load_config
from laminar_core.plugins import reset_default_manager
from laminar_core.testing import check_trainer_engine


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    files = dict(_FILE_BLOCK.findall(guide_section("## A complete example: laminar-hftrain")))
    assert {"pyproject.toml", "laminar_hftrain/engine.py", "tests/test_hftrain.py"} <= set(files)
    site = tmp_path_factory.mktemp("site")
    for rel, body in files.items():
        path = site / "laminar-hftrain" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    entry = r"\[project.entry-points.laminar\]\n(\w+) = \"([\w.]+)\""
    ep = re.search(entry, files["pyproject.toml"])
    assert ep, "the guide's pyproject.toml declares no laminar entry point"
    _dist(site, "laminar-hftrain", {ep[1]: ep[2]})
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site / "laminar-hftrain"))
        mp.syspath_prepend(str(site / "laminar-hftrain" / "tests"))
        mp.syspath_prepend(str(site))
        reset_default_manager()
        yield site
    reset_default_manager()
    for name in [m for m in sys.modules if m.startswith(("laminar_hftrain", "test_hftrain"))]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_guide_example_passes_the_trainer_kit(site: Path, tiny: str, tmp_path: Path) -> None:
    import test_hftrain  # the guide's own test file

    test_hftrain.test_contract(tiny, tmp_path)


def _variant(cls: type, model: str, rank: int, world: int):
    from laminar_hftrain.engine import HFTrainOptions

    cfg = load_config(
        None,
        [f"model.path={model}", "model.dtype=float32", "rollout.temperature=0.7",
         "run.steps=4", "trainer.mini_batches=2"],
    ).cfg  # fmt: skip
    return cls(cfg, HFTrainOptions(lr=1e-3, micro_batch_tokens=64))


class _IgnoresLossMask:
    """Trains every response token, whatever the loss mask says (what laminar-megatron
    did with a loss mask of the wrong length before core checked it)."""

    async def train_step(self, batch):
        for t in batch.trajectories:
            t.loss_mask = []
        return await super().train_step(batch)


class _PerPosition:
    """Returns the model's per-position log-probs instead of response rows."""

    def forward(self, micro_batches):
        return [self._logprobs(mb)[:, :1].expand(len(mb.index), 40) for mb in micro_batches]


@pytest.mark.parametrize(
    ("mixin", "message"),
    [
        (_IgnoresLossMask, "a trajectory whose loss_mask is longer than its response"),
        (_PerPosition, r"laminar_core\.training\.responses\(per_position, mb\.spans\)"),
    ],
)
def test_kit_fails_an_engine_that_breaks_a_rule(site, tiny, tmp_path, mixin, message) -> None:
    from laminar_hftrain.engine import HFTrainEngine

    broken = type(mixin.__name__, (mixin, HFTrainEngine), {})
    factory = functools.partial(_variant, broken, tiny)
    with pytest.raises((AssertionError, ValueError), match=message):
        asyncio.run(check_trainer_engine(factory, tiny, tmp_path))


def test_the_kit_checks_with_raises_that_python_O_keeps() -> None:
    tree = ast.parse(Path(trainer_kit.__file__).read_text())
    asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not asserts, f"laminar_core/testing/trainer.py has bare asserts at lines {asserts}"
