"""CPU compatibility for megatron-core: used only when CUDA is absent.

megatron-core is written for GPUs. With ``GPTModel`` on the local (non-Transformer-Engine)
layer spec, ``use_cpu_initialization=True``, fusions off and float32, its maths runs on CPU
tensors over gloo; what stops it is a handful of places that ask for CUDA by name:

1. ``torch.cuda.current_device()`` (about 200 call sites): buffers are allocated on
   ``device=torch.cuda.current_device()`` (the attention matmul's global buffer, DDP grad
   buffers, distributed-optimizer shards, pipeline p2p receive buffers). Without CUDA it
   raises; :func:`apply` makes it return ``"cpu"``, and ``torch.cuda.synchronize()`` (the
   pipeline's p2p exchange waits on the stream) a no-op.
2. The CUDA RNG tracker (``megatron.core.tensor_parallel.random``): named CUDA generators
   seeded by ``model_parallel_cuda_manual_seed`` and the CUDA RNG state that activation
   recompute saves and restores. :func:`apply` makes the tracker hold *CPU* generator states
   (fork = save, set, restore ``torch.get_rng_state``) and the recompute's "CUDA state" the
   CPU one.
3. Literal ``device="cuda"`` / ``.cuda()`` in the optimizer (found-inf and overflow flags,
   the grad-norm accumulator), the schedules' token counter, the default causal mask, the
   tied-embedding sync under pipeline parallelism and ``dist_checkpointing``'s exchange
   buffers. :func:`scope` runs megatron calls under a ``TorchFunctionMode`` that turns a
   CUDA device argument into CPU and ``Tensor.cuda()`` into a no-op. Torch function modes
   are per thread, so the engine enters :func:`scope` in every thread that calls megatron.

Nothing else is changed. With CUDA present :func:`apply` does nothing and :func:`scope` is
a null context. The patches in (1) and (2) are process-wide; in a CPU-only process the
originals could only have raised.

One more fix is about megatron's fallback when neither Apex nor Transformer Engine is
installed (always the case on CPU), so :func:`fix_torch_optimizer_resume` applies it whenever
megatron runs on ``torch.optim.AdamW``: that optimizer keeps a per-parameter ``step`` in its
state (TE/Apex's FusedAdam keep it per group). megatron-core 0.16.1's distributed optimizer
restores ``step`` from the param groups as *one* tensor shared by every parameter's state
(AdamW then adds 1 to it once per parameter per update, so the bias correction goes wrong),
then copies every state key of each parameter from the checkpoint's tensors, which skip
``step``: ``KeyError: 'step'`` on every load. The fix copies the other keys, leaves the
restored ``step`` alone and gives each parameter its own copy of it. And before the first
update AdamW has no state at all, which megatron's ``state_dict`` asserts on (it reads the
step from it): a load into a fresh engine first gives every parameter a zero state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def needed() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for CPU if CUDA is absent; returns whether the patches are on."""
    global _applied
    if _applied or not needed():
        return _applied
    import megatron.core.tensor_parallel.random as mrandom

    # GPU-only advice, and the fp32 optimizer reading ``.grad`` of its shard views (what
    # megatron does with float32 params): noise on CPU.
    warnings.filterwarnings("ignore", message="When using async grad allreduce", module="megatron")
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", module=__name__
    )
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    mrandom.CudaRNGStatesTracker.add = _tracker_add
    mrandom.CudaRNGStatesTracker.fork = _tracker_fork
    _applied = True
    return True


def fix_torch_optimizer_resume() -> bool:
    """Let the distributed optimizer load checkpoints on ``torch.optim.AdamW`` (see above);
    returns whether megatron uses torch's optimizer (and so the fix is on)."""
    import megatron.core.optimizer as moptim
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not getattr(moptim, "USING_PYTORCH_OPTIMIZER", False):
        return False
    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_laminar_fix", False):
        return True

    def set_states(self, model_param, tensors):
        if "step" in tensors:
            return original(self, model_param, tensors)
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        out = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()  # one counter per parameter
        return out

    original_sharded = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if is_loading:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if not self.optimizer.state[p]:  # no update yet: AdamW's zero state
                        self.optimizer.state[p].update(
                            step=torch.zeros((), dtype=torch.float32),
                            exp_avg=torch.zeros_like(p),
                            exp_avg_sq=torch.zeros_like(p),
                        )
        return original_sharded(self, model_sharded_state_dict or {}, is_loading, **kwargs)

    set_states._laminar_fix = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    return True


def scope() -> contextlib.AbstractContextManager:
    """A context in which megatron's CUDA-by-name tensors land on CPU (no-op with CUDA)."""
    return _CudaToCpu() if _applied else contextlib.nullcontext()


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # the optimizers dispatch on ``param.type() == "torch.cuda.FloatTensor"``
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _cpu_device() -> str:
    return "cpu"


def _no_sync(device: Any = None) -> None:
    """Nothing to wait for: CPU work is synchronous."""


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on a CPU generator state."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    gen = torch.Generator()
    gen.manual_seed(seed)
    self.states_[name] = gen.get_state()


@contextlib.contextmanager
def _tracker_fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
    """``CudaRNGStatesTracker.fork`` on the CPU generator: run under the named state, keep
    what it advanced to, restore the caller's state."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    outer_name = self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)
        self._current_state_name = outer_name
