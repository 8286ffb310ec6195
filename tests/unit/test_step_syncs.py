"""A step waits for the device once: when its sampled tokens are read (workers/engine/
step_io.py). Shown on the CPU by a sentinel, a torch function mode around the runner's step
that records every call which, on a GPU, blocks the host until the device catches up
(`.item()`, `.tolist()`, `bool(tensor)`, `torch.tensor(list, device=...)`, a boolean mask's
indexing, `.cpu()`), with the runner planning as it does on a GPU (`sync_free`).

The model's forward is left out: on a GPU a decode step's forward is a CUDA graph replay,
with no Python in it; here it is `EagerReplay`, or the CPU's own attention backend."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import EagerReplay
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams

FORBIDDEN = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.cpu,
    torch.masked_select,
    torch.Tensor.masked_select,
}


class SyncSentinel(TorchFunctionMode):
    """Records the calls that would wait for a GPU; off while `paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.paused = False
        self.steps = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and self._blocks(func, args, kwargs):
            self.calls.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **kwargs)

    @staticmethod
    def _blocks(func, args, kwargs) -> bool:
        if func in FORBIDDEN:
            return True
        if func in (torch.tensor, torch.as_tensor):  # from Python data: a blocking copy
            return not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor)
        if func is torch.Tensor.__getitem__:  # a boolean mask's shape depends on the data
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return False


def sentinel_engine(tiny_llama_dir, overlap: str = "off") -> tuple[LLMEngine, SyncSentinel]:
    """An engine whose runner launches every step under the sentinel (`sentinel.steps`
    counts them); with `overlap` on, the next step's decodes read the last one's tokens on
    the device."""
    cfg = EngineConfig(
        model=str(tiny_llama_dir), num_kv_blocks=128, block_size=4, max_num_seqs=8, overlap=overlap
    )
    engine = LLMEngine(cfg, make_graph=EagerReplay)
    assert engine.runner.graphs is not None  # decode steps replay
    runner, sentinel = engine.runner, SyncSentinel()
    runner.sync_free = True  # plan as on a GPU
    model_forward, launch = runner.model.forward, runner.launch

    def forward(*args, **kwargs):
        sentinel.paused = True
        try:
            return model_forward(*args, **kwargs)
        finally:
            sentinel.paused = False

    def watched(*args, **kwargs):
        sentinel.steps += 1
        with sentinel:
            return launch(*args, **kwargs)

    runner.model.forward, runner.launch = forward, watched
    return engine, sentinel


def test_the_sentinel_sees_each_kind_of_wait():
    """So that the test below cannot pass with a sentinel that sees nothing."""
    sentinel, x = SyncSentinel(), torch.arange(4.0)
    with sentinel:
        x.tolist(), x[0].item(), bool(x[1]), int(x[1]), x[x > 1], x.nonzero()
        torch.tensor([1, 2]), torch.as_tensor([3]), x.cpu()
        x[1:3], torch.as_tensor(x), x.index_select(0, torch.arange(2))  # none of these waits
    assert len(sentinel.calls) == 9, sentinel.calls


PARAMS = {
    "greedy": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
    "top-k": SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=4, ignore_eos=True),
    "top-p": SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, seed=5, ignore_eos=True),
    "both": SamplingParams(max_tokens=6, top_k=40, top_p=0.9, min_p=0.05, seed=6, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=6,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        seed=7,
        ignore_eos=True,
    ),
    "bias": SamplingParams(max_tokens=6, logit_bias={3: 5.0}, min_tokens=4, seed=8),
    "logprobs": SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True),
    "n=2": SamplingParams(max_tokens=6, n=2, temperature=0.9, seed=9, ignore_eos=True),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_step_never_waits_for_the_device_before_its_tokens_are_read(tiny_llama_dir, overlap):
    """Prefill and decode steps, with every sampling parameter but grammars (which may wait:
    their masks come from the host), batched together and alone: not one blocking call,
    the last step's tokens read on the device included (overlap)."""
    engine, sentinel = sentinel_engine(tiny_llama_dir, overlap)
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(len(PARAMS))]
    for prompt, sp in zip(prompts, PARAMS.values()):
        engine.add_request(prompt, sp)
    steps = 0
    while engine.has_unfinished() and steps < 200:
        engine.step()
        steps += 1
    assert not engine.has_unfinished()
    assert sentinel.calls == [] and sentinel.steps >= 6
    assert (engine.overlapped_steps > 0) == (overlap == "on")
    for name, sp in PARAMS.items():  # each alone: a batch of one kind
        engine.add_request([9, 8, 7, 6, 5], sp)
        while engine.has_unfinished():
            engine.step()
        assert sentinel.calls == [], name
