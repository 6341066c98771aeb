"""A model runner over several tensor-parallel ranks (DESIGN §10): rank 0 schedules and samples; before each of
its runner's calls it sends the other ranks the same call as a StepChannel message (page ids, counts, the
step's arrays), and every rank runs it on its own part of the model and of the pool. The page ids are the same
on every rank, so one scheduler and one page allocator serve them all."""
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from slora.adapters.packing import PackedAdapter
from slora.core.scheduler import ScheduledSeq, SchedulerOutput
from slora.execution import step_batch
from slora.execution.model_runner import ModelRunner
from slora.execution.pool_memory import PoolShape
from slora.execution.step_batch import StepAdapters, TokenFeed
from slora.execution.step_channel import Command, Message, StepChannel
from slora.execution.tensor_parallel import TensorParallelError


class OtherRanks(NamedTuple):
    """What rank 0 has of the other ranks: the channel to them, and a check that raises TensorParallelError
    naming one whose process has ended."""
    channel: StepChannel
    check_alive: Callable[[], None]


class ParallelRunner:
    """Rank 0's runner: what ModelRunner does, told to the other ranks first; a failed collective names the rank
    that ended."""

    def __init__(self, runner: ModelRunner, ranks: OtherRanks) -> None:
        self.runner, self.channel, self._check_ranks = runner, ranks.channel, ranks.check_alive

    @property
    def shape(self) -> PoolShape:
        return self.runner.shape

    def set_kv_scales(self, scales: Tensor) -> None:
        """Rank 0's part of an FP8 cache's scales (each rank finds its own heads' as it starts)."""
        self.runner.set_kv_scales(scales)

    def move_pages(self, out: SchedulerOutput, packed: Mapping[str, PackedAdapter]) -> None:
        with self._ranks_checked():
            if out.swap_out or out.swap_in or out.copies or out.adapters_to_load:
                self.channel.send(Command.MOVE_PAGES, *_moves_message(out))
                for version, _ in out.adapters_to_load:
                    for rank, pages in enumerate(packed[version].rank_pages, start=1):
                        self.channel.send_to(rank, pages)
            self.runner.move_pages(out, packed)

    def run(self, scheduled: list[ScheduledSeq], adapters: StepAdapters, sampled: Tensor | None = None) -> Tensor:
        host = self.runner.inputs_for(scheduled, adapters)
        feed = step_batch.token_feed(scheduled, sampled)
        ints, arrays = step_batch.flat_fields(host)
        feed_ints = [0, 0] if feed is None else [1, feed.sampled.shape[0]]
        rows, sources = ([], []) if feed is None else (feed.rows, feed.sources)
        feed_arrays = [np.array(rows, dtype=np.int64), np.array(sources, dtype=np.int64)]
        with self._ranks_checked():
            self.channel.send(Command.STEP, [len(scheduled), *feed_ints, *ints], [*feed_arrays, *arrays])
            if feed is not None:
                self.channel.broadcast_device(feed.sampled)
            return self.runner.execute(host, len(scheduled), feed, adapters)

    def stop(self) -> None:
        """Tell the other ranks to end (they leave their loop and the process group)."""
        self.channel.send(Command.STOP)

    @contextmanager
    def _ranks_checked(self) -> Iterator[None]:
        """A collective that fails (a rank gone: gloo and NCCL see its socket close at once) becomes a
        TensorParallelError naming the rank if its process has ended by then. The processes are not checked
        before each call: the server's loop checks them between steps (Engine.check_alive)."""
        try:
            yield
        except RuntimeError as exc:
            _wait_for_exit(self._check_ranks)
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(f"a tensor-parallel rank stopped answering during a step: {exc}") from exc


def _wait_for_exit(check_ranks: Callable[[], None], timeout_s: float = 2.0) -> None:
    """check_ranks until it names the rank that ended (a collective can fail just before its process exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_ranks()
        time.sleep(0.05)


def _moves_message(out: SchedulerOutput) -> tuple[list[int], list[np.ndarray]]:
    """A step's page moves as counts and flat page-id arrays: swap-outs, swap-ins (pairs of equal-length lists),
    copy-on-write pairs, then each adapter load's pages."""
    ints = [len(out.swap_out), len(out.swap_in), len(out.copies), len(out.adapters_to_load)]
    arrays = [*_pairs(out.swap_out), *_pairs(out.swap_in), np.array(out.copies, dtype=np.int64).reshape(-1, 2)]
    arrays += [np.array(pages, dtype=np.int64) for _, pages in out.adapters_to_load]
    return ints, arrays


def _pairs(moves: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """(sources, targets) lists as one `[moves, 2, ...]`-like pair of flat arrays and their lengths."""
    lengths = np.array([len(source) for source, _ in moves], dtype=np.int64)
    flat = np.array([page for move in moves for side in move for page in side], dtype=np.int64)
    return [lengths, flat]


def serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    """A rank other than 0: run what rank 0 sends, in order, until it says stop."""
    while True:
        message = channel.receive()
        if message.command is Command.STOP:
            return
        if message.command is Command.MOVE_PAGES:
            _apply_moves(runner, channel, message)
        else:
            _run_step(runner, channel, message)


def _apply_moves(runner: ModelRunner, channel: StepChannel, message: Message) -> None:
    num_out, num_in, _, num_loads = message.ints
    arrays = [array.tolist() for array in message.arrays]
    out = SchedulerOutput(swap_out=_unpaired(arrays[0], arrays[1]), swap_in=_unpaired(arrays[2], arrays[3]),
                          copies=[(source, target) for source, target in arrays[4]])
    assert (len(out.swap_out), len(out.swap_in)) == (num_out, num_in), "a moves message of other counts"
    shape = runner.shape
    host_pages = {}
    for index, pages in enumerate(arrays[5:5 + num_loads]):
        out.adapters_to_load.append((str(index), pages))
        received = torch.empty(shape.num_layers, len(pages), shape.page_elems, dtype=shape.dtype)
        host_pages[str(index)] = channel.receive_into(received)
    runner.apply_moves(out, host_pages)


def _unpaired(lengths: list[int], flat: list[int]) -> list[tuple[list[int], list[int]]]:
    moves, start = [], 0
    for length in lengths:
        moves.append((flat[start:start + length], flat[start + length:start + 2 * length]))
        start += 2 * length
    return moves


def _run_step(runner: ModelRunner, channel: StepChannel, message: Message) -> None:
    num_seqs, has_feed, sampled_rows, *ints = message.ints
    rows, sources, *arrays = (array.numpy() for array in message.arrays)
    feed = None
    if has_feed:
        sampled = torch.empty(sampled_rows, dtype=torch.int64, device=runner.device)
        feed = TokenFeed(rows.tolist(), sources.tolist(), channel.broadcast_device(sampled))
    runner.execute(step_batch.from_flat_fields(ints, arrays), num_seqs, feed)
