"""How the k replicas of one device compute their losses (and, through autograd, their gradients).

Every engine runs the user's own ``training_step`` once per replica with the module's parameters
and buffers swapped for that replica's slice of the :class:`~lightning_crossbow.replicas.ReplicaStack`
(:class:`~lightning_crossbow.stateless.Reparametrizer`, ``torch.func.functional_call``'s swap with the names
resolved once), and returns the ``k`` losses. Backpropagating their SUM gives each
replica the gradient of its own loss, in the stack's ``.grad``.

- :class:`FusedEngine`: one batched computation over the stack with ``torch.func.vmap``
  (``randomness="different"``: dropout draws differ per replica; called through
  :func:`~lightning_crossbow.lean_vmap.lean_vmap`); on CPU its ``nn.Conv1d`` layers run as one
  batched matrix product over the replicas, and ``F.cross_entropy``/``F.nll_loss`` as one call over them all
  (:mod:`~lightning_crossbow.fused_layers`); ``F.embedding`` takes a form that ``vmap`` gets right
  (:mod:`~lightning_crossbow.vmap_corrections`).
- :class:`SequentialEngine`: a Python loop over the replicas; runs any ``training_step``.
- :class:`StreamsEngine`: the sequential loop with each replica's work on its own CUDA stream
  (:mod:`~lightning_crossbow.streams`), so that the replicas' kernels can run side by side on the GPU.
- :class:`FusedOrSequentialEngine`: fused, falling back to sequential for good (with one warning naming the
  reason) the first time the user's ``training_step`` cannot run under ``vmap``.
- :class:`FastestEngine`: times candidate engines for a few steps and keeps the fastest (``"auto"`` on
  CUDA: fused against streams).
"""

from __future__ import annotations

import copy
import random
import re
import statistics
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Optional

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from typing_extensions import override

from lightning_crossbow.data import tensor_sequences
from lightning_crossbow.fused_layers import fusable_layers, fused_layers, fuses_on
from lightning_crossbow.kept_tensors import KeptTensors, has_module_hooks
from lightning_crossbow.lean_vmap import lean_vmap
from lightning_crossbow.log_capture import LogCapture
from lightning_crossbow.replicas import BufferSnapshot, ReplicaStack
from lightning_crossbow.stateless import Reparametrizer
from lightning_crossbow.streams import StreamPool
from lightning_crossbow.vmap_corrections import corrected_under_vmap

ENGINES = ("auto", "fused", "sequential", "streams")


class NotFusableError(RuntimeError):
    """The user's ``training_step`` cannot run under ``vmap``: it returned a dict with non-tensor values, it
    updates a torchmetrics metric, whose state cannot hold per-replica values, or the module has a layer whose
    gradients ``vmap`` cannot batch (:func:`layer_vmap_gets_wrong`)."""


def layer_changing_its_weight(module: nn.Module) -> Optional[str]:
    """The first layer of ``module`` that changes its weight in place during the forward, said as an error's
    reason; None when none. ``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag(max_norm=...)`` renormalise
    the rows they look up."""
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.max_norm is not None and _trained(layer):
            return (
                f"{name} ({type(layer).__name__}) has max_norm={layer.max_norm}, which renormalises the weight's rows"
                " in place during the forward"
            )
    return None


def _trained(layer: nn.Module) -> bool:
    """Whether the layer's weight is trained (so replicated per replica, with a gradient); a frozen one is not."""
    return bool(layer.weight.requires_grad)


def layer_vmap_gets_wrong(module: nn.Module) -> Optional[str]:
    """Why ``vmap`` cannot run ``module`` as the replicas need, for the first layer that it gets wrong; None when
    none. ``sparse=True`` (``nn.Embedding``, ``nn.EmbeddingBag``): sparse gradients cannot be batched, and the
    error comes only in the backward, after the fused step has run. (``nn.Embedding(padding_idx=...)``, which
    ``vmap``'s rule gets wrong, and functional ``F.embedding`` calls run in a corrected form:
    :mod:`~lightning_crossbow.vmap_corrections`.)"""
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and _trained(layer) and layer.sparse:
            return f"{name} ({type(layer).__name__}) has sparse=True, whose sparse gradients vmap cannot batch"
    return None


@dataclass
class ReplicaStepOutput:
    """What one step of ``k`` replicas returns: ``total`` (the sum of their losses, attached to the graph:
    its backward gives every replica its own gradient; None when every replica skipped the step), each
    replica's loss (detached, shape ``(k,)``; 0 for a skipped replica), the other entries of a dict output
    (merged over replicas: :func:`_merge_extras`), and which replicas skipped the step (their
    ``training_step`` returned None; None when none did)."""

    total: Optional[Tensor]
    losses: Tensor
    extras: dict[str, Any] = field(default_factory=dict)
    returned_dict: bool = False
    skipped: Optional[Tensor] = None


def _split_output(output: Any) -> tuple[Optional[Tensor], dict[str, Any], bool]:
    """``(loss, the dict's other items, whether training_step returned a dict)``; an error where the output or its
    loss is not one Lightning's automatic optimization can backpropagate (every engine raises the same one)."""
    if output is None or isinstance(output, Tensor):
        return _one_number(output), {}, False
    if isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
        if not isinstance(loss, Tensor):  # (plain Lightning refuses a None 'loss' too)
            raise TypeError(
                f"training_step returned a dict whose 'loss' is {_type_name(loss)}; it must be a tensor that"
                " automatic optimization can backpropagate (to skip the batch, return None instead of the dict)."
            )
        return _one_number(loss), {k: v for k, v in output.items() if k != "loss"}, True
    raise TypeError(
        f"training_step must return a loss tensor, a dict with a 'loss' key, or None; got {type(output).__name__}."
    )


def _type_name(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _one_number(loss: Optional[Tensor]) -> Optional[Tensor]:
    """``loss`` where it holds one number (of any shape: ``()``, ``(1,)``, ...), as Lightning's backward needs it (its
    ``backward`` raises "grad can be implicitly created only for scalar outputs" otherwise); RuntimeError else."""
    if loss is not None and loss.numel() != 1:
        raise RuntimeError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; automatic optimization backpropagates a loss"
            " of one number (plain Lightning's backward refuses this one too). Reduce it, with .mean() or .sum()."
        )
    return loss


class Engine(ABC):
    """Computes the losses of all replicas of one device for one group of ``k`` batches."""

    name: str

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._reparametrizer: Optional[Reparametrizer] = None  # for the stack's names, made at the first step

    def _training_step(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        batch: Any,
        args: Sequence[Any],
        replaced: Optional[dict[str, Tensor]] = None,
    ) -> Any:
        """``module.training_step(batch, *args)`` run with ``params`` and ``buffers`` in place of the module's own;
        the buffers it replaced with other tensors (not in place) go into ``replaced``, by name."""
        if self._reparametrizer is None:
            self._reparametrizer = Reparametrizer(self.module, [*params, *buffers])
        with self._reparametrizer({**params, **buffers}) as replaced_here:
            output = self.module.training_step(batch, *args)
        if replaced is not None:
            replaced.update(replaced_here)
        return output

    @abstractmethod
    def run(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> ReplicaStepOutput:
        """Runs ``training_step(batches[j], *args)`` for every replica ``j``."""

    def timed(self) -> ContextManager[Any]:
        """Wraps one step's forward and backward: an engine that chooses by measurement times it."""
        return nullcontext()

    @property
    def uses_streams(self) -> bool:
        """Whether the replicas run on the CUDA streams of a :class:`StreamPool` (then so does the averaging)."""
        return False

    @property
    def fused_failed(self) -> bool:
        """Whether the user's ``training_step`` proved unable to run fused (so a new engine need not try)."""
        return False

    def fall_back_after_backward(self, stack: ReplicaStack, capture: LogCapture) -> bool:
        """Called when the step's backward raised inside autograd after its forward ran: an engine that ran the step
        fused and may fall back undoes what the forward did and runs sequentially from now on (True: the caller runs
        the step again); False otherwise (the error stands)."""
        return False

    def after_rerun(self, error: BaseException, again: Optional[BaseException]) -> None:
        """After the step that :meth:`fall_back_after_backward` undid ran again: ``again`` is what that raised."""

    @property
    def measuring(self) -> bool:
        """Whether the engine is still timing candidates (its steps are not yet representative)."""
        return False


_CHANGED_A_PARAMETER_IN_PLACE = (
    "crossbow: the training_step changed a parameter in place (a clamp_ or a renormalisation under torch.no_grad(),"
    " say). The sequential engine hands each replica its weights as views of the stacked replicas, which autograd"
    " does not let a step change in place. Change them outside the step (in on_train_batch_start, or in a callback"
    " after the optimizer step), or use engine='fused', which runs such a step (every group of batches stackable:"
    " batches of one size)."
)


class SequentialEngine(Engine):
    """One ``training_step`` call per replica, in a loop. Runs anything plain Lightning runs, except, with several
    replicas, a layer that changes its weight in place during the forward (:func:`layer_changing_its_weight`)."""

    name = "sequential"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._weight_changer: Optional[str] = None  # (found at the first step with several replicas; "" for none)
        #: Per replica of the last step: its buffers, and those its training_step replaced (not in place).
        self._replaced: list[tuple[Mapping[str, Tensor], dict[str, Tensor]]] = []

    @override
    def run(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> ReplicaStepOutput:
        outputs = self._replica_outputs(stack, batches, args, capture)
        names = {name for _, replaced in self._replaced for name in replaced}
        if names:  # (after every replica's stream is done)
            keep_replaced_buffers(stack, {name: [r.get(name, b[name]) for b, r in self._replaced] for name in names})
        self._replaced = []
        losses: list[Tensor] = []
        extras: list[dict[str, Any]] = []
        returned_dict = False
        skipped = []
        for output in outputs:
            loss, extra, is_dict = _split_output(output)
            returned_dict |= is_dict
            skipped.append(loss is None)  # a replica whose training_step returns None skips the step
            if loss is not None:
                losses.append(loss)
            extras.append(extra)
        # One replica: its loss is the total as it is (no stack and sum nodes in the backward graph).
        total = None if not losses else losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if not any(skipped):
            detached = torch.stack([loss.detach().reshape(()) for loss in losses])  # (one number each)
            return ReplicaStepOutput(total, detached, _merge_extras(extras), returned_dict)
        found, device = iter(loss.detach().reshape(()) for loss in losses), _device_of(stack)
        detached = torch.stack([torch.zeros((), device=device) if skip else next(found) for skip in skipped])
        skipped_rows = torch.tensor(skipped, device=device)
        return ReplicaStepOutput(total, detached, _merge_extras(extras), returned_dict, skipped_rows)

    def _replica_outputs(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> list[Any]:
        """What every replica's ``training_step`` returned, in replica order."""
        if stack.num_replicas > 1:
            if self._weight_changer is None:
                self._weight_changer = layer_changing_its_weight(self.module) or ""
            if self._weight_changer:
                raise RuntimeError(
                    f"crossbow: {self._weight_changer}. With several replicas their weights are views of one"
                    " storage, which autograd does not let one replica's forward change while another's step holds"
                    " it, so the sequential engine cannot run it. engine='fused' (or 'auto') runs such a layer"
                    " where every group of batches can be stacked: batches of one size (drop_last=True)."
                )
        outputs = []
        self._replaced = []
        for index, ((params, buffers), batch) in enumerate(zip(stack.unbind(), batches, strict=True)):
            replaced: dict[str, Tensor] = {}
            with self._replica_context(index), capture.recording(self.module) as calls:
                try:
                    outputs.append(self._training_step(params, buffers, batch, args, replaced))
                except RuntimeError as error:
                    if "of Unbind" in str(error) and "modified inplace" in str(error):
                        raise RuntimeError(_CHANGED_A_PARAMETER_IN_PLACE) from error
                    raise
            capture.add(calls, batch)
            self._replaced.append((buffers, replaced))
        return outputs

    def _replica_context(self, index: int) -> ContextManager[Any]:
        """Where replica ``index``'s work is queued: here, wherever the step is."""
        return nullcontext()


class StreamsEngine(SequentialEngine):
    """Each replica's forward (and so its backward) on its own CUDA stream of a :class:`StreamPool`.

    The replicas' streams wait for the work queued before the step; the losses are combined on the
    issuing stream once every replica stream is done (also when a replica's step fails). The batches'
    tensors on the device are kept from reuse until the replica streams are done with them.

    Replicas on different streams run at the same time, so their ``training_step`` must not update
    tensors that all replicas share. The first step runs the replicas one after another on the issuing
    stream and watches the module's torchmetrics metrics: if the ``training_step`` updates one, every
    later step runs so too, with a warning that names it.
    """

    name = "streams"

    def __init__(self, module: nn.Module, pool: StreamPool) -> None:
        super().__init__(module)
        self.pool = pool
        self._streams: list[Any] = []
        #: Whether the replicas run on their own streams (False once the training_step proved to update a metric).
        self.concurrent = True
        self._checked = False  # whether the first step has run (one replica after another, watching metrics)

    @override
    def _replica_outputs(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> list[Any]:
        if not self._checked:
            return self._first_outputs(stack, batches, args, capture)
        if not self.concurrent:
            return super()._replica_outputs(stack, batches, args, capture)  # (no _streams: all on the issuing stream)
        issuing = self.pool.current()
        self._streams = self.pool.replica_streams(len(batches))
        for stream, batch in zip(self._streams, batches):
            self.pool.wait(stream, issuing)
            for leaf in tree_flatten(batch)[0]:
                if isinstance(leaf, Tensor) and leaf.device == self.pool.device:
                    self.pool.keep_for(leaf, stream)
        try:
            return super()._replica_outputs(stack, batches, args, capture)
        finally:  # what follows on the issuing stream (the losses' sum, or an out-of-memory back-off) waits
            for stream in self._streams:
                self.pool.wait(issuing, stream)

    def _first_outputs(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> list[Any]:
        """The first step: the replicas one after another on the issuing stream, watching the module's metrics."""
        updates = {metric: _update_count(metric) for metric in _metrics_of(self.module)}
        outputs = super()._replica_outputs(stack, batches, args, capture)
        self._checked = True
        updated = sorted({type(m).__name__ for m, count in updates.items() if _update_count(m) != count})
        if updated:
            self.concurrent = False
            warnings.warn(
                f"crossbow: engine='streams': the training_step updates the torchmetrics metric(s)"
                f" {', '.join(updated)}, which all replicas share; on concurrent CUDA streams their updates"
                " would race, so the replicas run one after another on one stream.",
                stacklevel=2,
            )
        return outputs

    @override
    def _replica_context(self, index: int) -> ContextManager[Any]:
        return self.pool.use(self._streams[index]) if self._streams else nullcontext()

    @property
    @override
    def uses_streams(self) -> bool:
        return self.concurrent


class FusedEngine(Engine):
    """All replicas in one batched computation: ``vmap`` over the stacked parameters, buffers and batches.

    A group whose batches cannot be stacked (a smaller last batch, differing non-tensor fields) runs
    through the sequential engine for that step only. With ``says_why`` (``engine="fused"``, chosen by the user),
    an error that ``training_step`` raises under ``vmap`` gets a note saying so, and which engine runs such steps.
    """

    name = "fused"

    def __init__(self, module: nn.Module, says_why: bool = False) -> None:
        super().__init__(module)
        self.says_why = says_why
        self.sequential = SequentialEngine(module)  #: for groups whose batches cannot be stacked
        self._autocast_warned = False
        self._fused_layers: Optional[list[nn.Module]] = None  #: the layers run fused (found at the first step)
        self._submodules: Optional[list[nn.Module]] = None  #: the module and its submodules (listed at the first step)
        self._wrong_layer: Optional[str] = None  #: why vmap gets a layer wrong ("" for none; found at the first step)
        self.metrics = _metrics_of(module)  #: the module's torchmetrics metrics (walked once)
        self.ran_fused = False  #: whether the last step ran under vmap (not a group that could not be stacked)

    def _warn_if_autocast(self, device: torch.device) -> None:
        """Mixed precision under vmap is partial: say so once."""
        if self._autocast_warned or not torch.is_autocast_enabled(device.type):
            return
        self._autocast_warned = True
        warnings.warn(
            "crossbow: under torch.func.vmap, autocast leaves some operations in float32 (linear layers with a"
            " bias and convolutions, among others; a PyTorch limitation), so engine='fused' runs mixed precision"
            " only in part. engine='sequential' (or 'streams' on CUDA) autocasts every operation.",
            stacklevel=2,
        )

    @override
    def run(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> ReplicaStepOutput:
        if self._wrong_layer is None:
            self._wrong_layer = layer_vmap_gets_wrong(self.module) or ""
        if self._wrong_layer:
            raise NotFusableError(f"{self._wrong_layer}; use engine='auto' or 'sequential'")
        self.ran_fused = False
        batch = _stack_batches(batches)
        if batch is None:
            return self.sequential.run(stack, batches, args, capture)
        device = _device_of(stack)
        self._warn_if_autocast(device)
        recorded: list[Any] = []
        returned_dict = [False]
        skipped_all = [False]
        plain_extras: dict[str, Any] = {}  # the dict output's values that are plain numbers (one for every replica)
        extras_order: list[str] = []

        def one_replica(params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any) -> Any:
            replaced: dict[str, Tensor] = {}
            with capture.recording(self.module) as calls:
                output = self._training_step(params, buffers, batch, args, replaced)
            recorded[:] = calls
            loss, extra, returned_dict[0] = _split_output(output)
            logged = [c.value for c in calls if isinstance(c.value, Tensor)]
            if loss is None:  # one control flow for every replica under vmap: all of them skip
                skipped_all[0] = True
                return torch.zeros((), device=device), {}, logged, replaced
            tensors = {key: value for key, value in extra.items() if isinstance(value, Tensor)}
            others = {key: value for key, value in extra.items() if key not in tensors}
            if not all(_plain_numbers(value) for value in others.values()):
                raise NotFusableError(
                    "training_step returned a dict with values that are neither tensors nor plain numbers (None,"
                    " numbers, and lists, tuples and dicts of them: a string may show every replica's data under vmap)"
                )
            plain_extras.update(others)  # (under vmap one control flow: every replica's value is this one)
            extras_order[:] = extra
            return loss, tensors, logged, replaced

        if self._fused_layers is None:
            self._fused_layers = fusable_layers(self.module, device)
            self._submodules = list(self.module.modules())
        trainer = getattr(self.module, "_trainer", None)
        callbacks = trainer.callbacks if trainer is not None else ()
        kept = KeptTensors(self.module, callbacks, hooks=bool(callbacks) and has_module_hooks(self._submodules or ()))
        try:
            with fused_layers(self._fused_layers, losses=fuses_on(device)), corrected_under_vmap():
                losses, extras, logged, replaced = lean_vmap(
                    one_replica, stack.num_replicas, stack.params, stack.buffers, batch
                )
            escaped = kept.escaped()
            if escaped is not None:
                raise NotFusableError(
                    f"the step keeps tensors computed under vmap in {escaped}, where they would escape it (the"
                    " sequential engine keeps each replica's own); use engine='auto' or 'sequential'"
                )
            _check_no_escaped_metric_state(self.metrics)
        except Exception as error:
            kept.undo()  # (a step run again, sequentially or with fewer replicas, starts from the same attributes)
            if (
                self.says_why
                and not isinstance(error, (NotFusableError, torch.cuda.OutOfMemoryError))
                and hasattr(error, "add_note")  # (Python 3.11 on)
            ):
                error.add_note(
                    "crossbow: this came from training_step run under torch.func.vmap (engine='fused'). Where vmap"
                    " cannot run a step, engine='auto' runs it sequentially."
                )
            raise
        self.ran_fused = True
        capture.add_stacked(recorded, logged, stack.num_replicas)
        keep_replaced_buffers(stack, replaced)
        if skipped_all[0]:
            k = stack.num_replicas
            every = torch.ones(k, dtype=torch.bool, device=device)
            return ReplicaStepOutput(None, torch.zeros(k, device=device), {}, returned_dict[0], every)
        copies = {key: [copy.deepcopy(v) for _ in range(stack.num_replicas)] for key, v in plain_extras.items()}
        merged = {**_merge_stacked_extras(extras), **copies}
        extras = {key: merged[key] for key in extras_order}  # (in the order training_step gave them)
        return ReplicaStepOutput(losses.sum(), losses.detach().reshape(stack.num_replicas), extras, returned_dict[0])


class FusedOrSequentialEngine(Engine):
    """Fused; on the first failure of the user's ``training_step`` under ``vmap``, sequential for good.

    Every fused step is guarded, not only the first: code that ``vmap`` cannot run may appear at any step
    (a branch on ``batch_idx``, a callback that changes a layer). The failed attempt is undone: the
    replicas' buffers are restored from a copy taken before each fused step, the metrics' state and the
    random number generators' (the attempt's dropout draws) are restored, its logs are dropped, and what it did to
    the module's own attributes is undone (:mod:`~lightning_crossbow.kept_tensors`); the sequential run of that step
    is then the one ``engine="sequential"`` would have made, unless the step changed other state of its own (a
    counter elsewhere than on the module, items added to a long list), which the attempt changed once already.
    A step whose forward ran fused and whose backward then fails (``vmap``'s rules for the backward, say under
    activation checkpointing) is undone the same way, but for the module's attributes, and run again by the
    strategy (:meth:`fall_back_after_backward`).
    """

    name = "auto"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.fused = FusedEngine(module)
        self.sequential = self.fused.sequential
        self.active: Engine = self.fused
        self._buffers = BufferSnapshot()  # the replicas' buffers before each fused step
        self._undo: Optional[Callable[[ReplicaStack], None]] = None  # the last fused step's, until its backward ran

    @override
    def run(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> ReplicaStepOutput:
        self._undo = None
        if self.active is self.sequential:
            return self.sequential.run(stack, batches, args, capture)
        self._buffers.take(stack)
        saved_metrics = MetricSnapshots(self.fused.metrics)
        random_state = RandomState(_device_of(stack))

        def undo(stack: ReplicaStack) -> None:
            self._buffers.restore_(stack)
            saved_metrics.restore()
            random_state.restore()

        try:
            with saved_metrics.taken_at_first_use():
                output = self.fused.run(stack, batches, args, capture)
        except Exception as error:  # noqa: BLE001 - any failure under vmap means: run it sequentially
            undo(stack)
            capture.clear()
            if isinstance(error, torch.cuda.OutOfMemoryError):
                raise  # not a vmap failure: the strategy backs off one replica (the step left nothing behind)
            self.active = self.sequential
            self._buffers.clear()
            try:
                output = self.sequential.run(stack, batches, args, capture)
            except Exception as again:
                if _same_error(again, error):
                    self.active = self.fused  # the step's own error, raised either way: not vmap's doing
                    raise
                self._warn_of_fallback(error)
                raise
            self._warn_of_fallback(error)
        if self.fused.ran_fused:
            self._undo = undo
        return output

    @override
    def fall_back_after_backward(self, stack: ReplicaStack, capture: LogCapture) -> bool:
        undo, self._undo = self._undo, None
        if undo is None:
            return False
        undo(stack)
        capture.clear()
        self.active = self.sequential
        self._buffers.clear()
        return True

    @override
    def after_rerun(self, error: BaseException, again: Optional[BaseException]) -> None:
        if again is not None and _same_error(again, error):
            self.active = self.fused  # the step's own error, raised either way: not vmap's doing
            return
        self._warn_of_fallback(error, "the training_step's backward")

    @staticmethod
    def _warn_of_fallback(error: BaseException, part: str = "the training_step") -> None:
        warnings.warn(
            f"crossbow: {part} cannot run fused under torch.func.vmap"
            f" ({type(error).__name__}: {_first_line(error)}). Falling back to engine='sequential' for the rest of"
            " training; pass engine='sequential' to silence this warning.",
            stacklevel=3,
        )

    @property
    @override
    def fused_failed(self) -> bool:
        return self.active is self.sequential


#: A shape in an error message: ``[4, 16]``, ``[3]``, ``[]``.
_SHAPES = re.compile(r"\[[\d, ]*\]")


def _same_error(again: BaseException, error: BaseException) -> bool:
    """Whether the sequential run raised what the fused attempt raised (the step's own error, not ``vmap``'s doing):
    the same type and message, but for the shapes it names (``[3, 4, 16]`` under ``vmap`` is ``[4, 16]`` for one
    replica, as in autograd's "modified by an inplace operation")."""
    return type(again) is type(error) and _SHAPES.sub("[...]", str(again)) == _SHAPES.sub("[...]", str(error))


def keep_replaced_buffers(stack: ReplicaStack, replaced: Mapping[str, Any]) -> None:
    """The buffers that the replicas' ``training_step`` replaced (``self.mean = ...``), kept: each named stack
    becomes a new tensor of the replicas' new values (``(k, ...)``, or one value per replica). The stack it
    replaces is left as it was, as plain Lightning leaves the replaced tensor: autograd may hold it."""
    for name, values in replaced.items():
        old = stack.buffers[name]
        rows = torch.stack(list(values)) if isinstance(values, (list, tuple)) else values
        stack.buffers[name] = rows.detach().to(old.dtype).reshape(old.shape).clone()


class MetricSnapshots:
    """The state of each torchmetrics metric that a fused attempt uses (:func:`metric_state`), taken as its first
    ``update`` or ``forward`` of the attempt starts; :meth:`restore` gives it back. A metric the attempt does not use
    (a validation metric, during a training step) costs nothing."""

    _ENTRIES = ("update", "forward")

    def __init__(self, metrics: Iterable[nn.Module]) -> None:
        self.metrics = list(metrics)
        #: by the metric's id (a torchmetrics metric hashes by its state, which the attempt changes): it and its state
        self.saved: dict[int, tuple[nn.Module, dict[str, Any]]] = {}

    @contextmanager
    def taken_at_first_use(self) -> Iterator[None]:
        """While open, each metric's ``update`` and ``forward`` first take its snapshot (torchmetrics' own wrapped
        ``update``, an instance attribute, is put back as it was)."""
        own = [{name: vars(metric).get(name) for name in self._ENTRIES} for metric in self.metrics]
        for metric in self.metrics:
            for name in self._ENTRIES:
                vars(metric)[name] = self._first_takes_a_snapshot(metric, getattr(metric, name))
        try:
            yield
        finally:
            for metric, entries in zip(self.metrics, own, strict=True):
                for name, entry in entries.items():
                    if entry is None:
                        vars(metric).pop(name, None)
                    else:
                        vars(metric)[name] = entry

    def _first_takes_a_snapshot(self, metric: nn.Module, call: Callable[..., Any]) -> Callable[..., Any]:
        def snapshot_then_call(*args: Any, **kwargs: Any) -> Any:
            if id(metric) not in self.saved:
                self.saved[id(metric)] = (metric, metric_state(metric))
            return call(*args, **kwargs)

        return snapshot_then_call

    def restore(self) -> None:
        """Gives each metric used its state from before the attempt."""
        for metric, state in self.saved.values():
            vars(metric).update(state)


def metric_state(metric: nn.Module) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s attributes as they are (but the ``update`` and ``forward`` that
    :class:`MetricSnapshots` puts in), its states (``add_state``'s, named in ``_defaults``) by value: an update under
    ``vmap`` may change a state tensor in place (``SumMetric``'s sum), which a copy of the attributes alone would then
    hold changed. A list state is copied (its tensors are appended, not changed)."""
    saved = {name: value for name, value in vars(metric).items() if name not in MetricSnapshots._ENTRIES}
    for name in getattr(metric, "_defaults", {}):
        value = saved.get(name)
        if isinstance(value, Tensor):
            saved[name] = value.clone()
        elif isinstance(value, list):
            saved[name] = list(value)
    return saved


class RandomState:
    """The random number generators' state, taken when made: torch's on the CPU, and on ``device`` when it is a CUDA
    device (where ``vmap`` and the layers draw), Python's (``random``) and NumPy's global ones (a mixup's draw)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def restore(self) -> None:
        """Puts the generators back where they were."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


class FastestEngine(Engine):
    """Runs each candidate engine for a few steps, times them, and keeps the fastest from then on.

    Each candidate first runs ``warmup`` unmeasured steps (allocations, kernel selection); then the
    candidates take turns for ``trials`` measured steps each, so that a slow phase of a shared device
    falls on all of them. A step's time is its forward and backward (:meth:`timed`, which the strategy
    wraps around them), between two ``synchronize()`` calls so that queued device work is counted. The
    candidate with the smallest median time (summed over the processes, so that every rank keeps the same)
    wins. On CUDA, ``engine="auto"`` chooses so between fused (falling back to sequential) and streams.
    Given ``chosen`` (a choice measured before, at the same number of replicas), it measures nothing.
    """

    name = "auto"

    def __init__(
        self,
        module: nn.Module,
        candidates: Mapping[str, Engine],
        warmup: int = 2,
        trials: int = 5,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] = lambda: None,
        all_reduce_sum: Callable[[Tensor], Tensor] = lambda medians: medians,
        chosen: Optional[str] = None,
    ) -> None:
        super().__init__(module)
        if not candidates:
            raise ValueError("FastestEngine needs at least one candidate engine.")
        if chosen is not None and chosen not in candidates:
            raise ValueError(f"chosen must be one of the candidates {list(candidates)}, got {chosen!r}.")
        self.candidates = dict(candidates)
        self.clock, self.synchronize, self.all_reduce_sum = clock, synchronize, all_reduce_sum
        names = list(self.candidates)
        #: The candidate of every trial step, in order; the first ``len(names) * warmup`` are not measured.
        self.schedule = [n for n in names for _ in range(warmup)] + [n for _ in range(trials) for n in names]
        self._unmeasured = len(names) * warmup
        self._trial = 0
        #: Measured seconds per step of each candidate.
        self.seconds: dict[str, list[float]] = {n: [] for n in names}
        #: The name of the candidate kept (None while trials run).
        self.chosen: Optional[str] = chosen
        self.active: Engine = self.candidates[chosen or names[0]]

    @override
    def run(
        self, stack: ReplicaStack, batches: Sequence[Any], args: Sequence[Any], capture: LogCapture
    ) -> ReplicaStepOutput:
        if self.chosen is None:
            self.active = self.candidates[self.schedule[self._trial]]
        return self.active.run(stack, batches, args, capture)

    @contextmanager
    @override
    def timed(self) -> Iterator[None]:
        if self.chosen is not None:
            yield
            return
        name = self.schedule[self._trial]
        self.synchronize()
        started = self.clock()
        yield
        self.synchronize()
        if self._trial >= self._unmeasured:
            self.seconds[name].append(self.clock() - started)
        self._trial += 1
        if self._trial == len(self.schedule):
            self._choose()

    def _choose(self) -> None:
        """Keeps the candidate with the smallest median time, summed over the processes: every rank keeps the same."""
        names = list(self.seconds)
        summed = self.all_reduce_sum(
            torch.tensor([statistics.median(self.seconds[n]) for n in names], dtype=torch.float64)
        )
        medians = dict(zip(names, summed.tolist()))
        self.chosen = min(medians, key=medians.__getitem__)
        self.active = self.candidates[self.chosen]
        measured = ", ".join(
            f"{_engine_label(name, self.candidates[name])} {1e3 * t:.2f}" for name, t in medians.items()
        )
        rank_zero_info(
            f"crossbow: engine='auto' measured forward+backward ms per step: {measured}; keeping {self.chosen!r}."
        )

    @property
    @override
    def uses_streams(self) -> bool:
        return self.active.uses_streams

    @property
    @override
    def measuring(self) -> bool:
        return self.chosen is None

    @property
    @override
    def fused_failed(self) -> bool:
        return any(engine.fused_failed for engine in self.candidates.values())

    @override
    def fall_back_after_backward(self, stack: ReplicaStack, capture: LogCapture) -> bool:
        return self.active.fall_back_after_backward(stack, capture)

    @override
    def after_rerun(self, error: BaseException, again: Optional[BaseException]) -> None:
        self.active.after_rerun(error, again)


def make_engine(
    name: str,
    module: nn.Module,
    num_replicas: int,
    streams: Optional[StreamPool] = None,
    fused_failed: bool = False,
    all_reduce_sum: Callable[[Tensor], Tensor] = lambda medians: medians,
    fastest: Optional[str] = None,
) -> Engine:
    """The engine called ``name``, for ``num_replicas`` replicas.

    ``"auto"`` is fused, falling back to sequential (directly sequential when ``fused_failed``); given a
    CUDA ``streams`` pool it is whichever of that and ``"streams"`` measures faster (:class:`FastestEngine`; the
    processes agree through ``all_reduce_sum``), or ``fastest`` without measuring when that was measured before.
    With one replica ``"auto"``, ``"fused"`` and ``"sequential"`` all loop once (no vmap, nothing to choose).
    """
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {name!r}.")
    if name == "streams":
        if streams is None:
            raise ValueError(STREAMS_NEED_CUDA.format(device="a device that is not CUDA"))
        return StreamsEngine(module, streams)
    if name == "sequential" or num_replicas == 1:
        return SequentialEngine(module)
    if name == "fused":
        return FusedEngine(module, says_why=True)
    fused: Engine = SequentialEngine(module) if fused_failed else FusedOrSequentialEngine(module)
    if streams is None:
        return fused
    return FastestEngine(
        module,
        {"fused": fused, "streams": StreamsEngine(module, streams)},
        synchronize=streams.synchronize,
        all_reduce_sum=all_reduce_sum,
        chosen=fastest,
    )


STREAMS_NEED_CUDA = (
    "engine='streams' runs every replica on its own CUDA stream and needs a CUDA device; this run is on {device}."
    " Use engine='auto', 'fused' or 'sequential'."
)


def _first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__


def _engine_label(name: str, engine: Engine) -> str:
    """A candidate's name, with what it became if it changed (fused falling back to sequential)."""
    actual = getattr(engine, "active", engine).name
    return name if actual in (name, "auto") else f"{name} ({actual})"


def _metrics_of(module: nn.Module) -> list[nn.Module]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return []
    return [m for m in module.modules() if isinstance(m, Metric)]


def _update_count(metric: nn.Module) -> int:
    """How many times a torchmetrics metric's ``update`` has run."""
    return int(getattr(metric, "_update_count", 0))


def _check_no_escaped_metric_state(metrics: Iterable[nn.Module]) -> None:
    """A torchmetrics update under vmap stores per-replica (batched) tensors in the metric: refuse it."""
    from torch._C._functorch import is_functorch_wrapped_tensor

    for metric in metrics:
        for name in getattr(metric, "_defaults", {}):
            values = getattr(metric, name)
            for value in values if isinstance(values, list) else [values]:
                if isinstance(value, Tensor) and is_functorch_wrapped_tensor(value):
                    raise NotFusableError(
                        f"training_step updates the torchmetrics metric {type(metric).__name__}, whose state"
                        " cannot hold per-replica values under vmap"
                    )


def _stack_batches(batches: Sequence[Any]) -> Optional[Any]:
    """One batch whose tensors are the ``k`` batches' tensors stacked on a new dim 0 (its other values shared).

    ``None`` when the batches differ in structure, in a tensor's shape, dtype or device, or in a
    non-tensor value (:func:`_same_value`): such a group cannot be stacked.
    """
    if tensor_sequences(batches):  # the common ``(x, y)`` batches, without flattening each
        columns = list(zip(*batches))
        if not all(_one_kind(column) for column in columns):
            return None
        kind = type(batches[0])
        return kind(torch.stack(column) for column in columns)
    leaves, spec = tree_flatten(batches[0])
    columns = [[leaf] for leaf in leaves]
    for other in batches[1:]:
        other_leaves, other_spec = tree_flatten(other)
        if other_spec != spec:
            return None
        for column, leaf in zip(columns, other_leaves):
            first = column[0]
            if isinstance(first, Tensor) != isinstance(leaf, Tensor):
                return None
            if not isinstance(first, Tensor) and not _same_value(leaf, first):
                return None
            column.append(leaf)
    if not all(_one_kind(column) for column in columns if isinstance(column[0], Tensor)):
        return None
    stacked = [torch.stack(column) if isinstance(column[0], Tensor) else column[0] for column in columns]
    return tree_unflatten(stacked, spec)


def _one_kind(tensors: Sequence[Tensor]) -> bool:
    """Whether the tensors have one shape, dtype and device (so that they stack)."""
    first = tensors[0]
    return all(t.shape == first.shape and t.dtype == first.dtype and t.device == first.device for t in tensors)


def _same_value(value: Any, other: Any) -> bool:
    """Whether two non-tensor fields of the replicas' batches are one value, which every replica may share. A value
    whose comparison is not a plain truth value (a dataclass holding tensors, a numpy array) counts as differing:
    its group runs sequentially."""
    if value is other:
        return True
    try:
        return bool(value == other)
    except (RuntimeError, ValueError, TypeError):
        return False


def _merge_extras(extras: list[dict[str, Any]]) -> dict[str, Any]:
    """The other entries of the replicas' dict outputs, as ``on_train_batch_end``'s ``outputs`` shows them.

    With one replica, its own entries. Otherwise a floating-point scalar tensor (a metric) is the mean
    over the replicas that returned it, as ``self.log`` logs it, and anything else (per-sample
    predictions, integers, objects) a list with replica j's value at index j, as the step's batch is
    (None for a replica that did not return the entry: it skipped the step).
    """
    if len(extras) == 1:
        return dict(extras[0])
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(key for extra in extras for key in extra):  # every replica's keys, in order
        values = [extra.get(key) for extra in extras]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point() for v in present):
            merged[key] = torch.stack([v.detach() for v in present]).mean(0)
        else:
            merged[key] = [v.detach() if isinstance(v, Tensor) else v for v in values]
    return merged


def _merge_stacked_extras(extras: dict[str, Tensor]) -> dict[str, Any]:
    """:func:`_merge_extras` for the fused engine's outputs, stacked on a leading replica dim."""
    return {
        key: value.detach().mean(0)
        if value.dim() == 1 and value.is_floating_point()
        else list(value.detach().unbind(0))
        for key, value in extras.items()
    }


def _plain_numbers(value: Any) -> bool:
    """Whether ``value`` is None, a bool or a number, or a list, tuple or dict (keyed by strings or numbers) of such:
    what a ``training_step`` under vmap cannot compute from a replica's data (a tensor's ``.item()`` raises there),
    so the one value it computes is every replica's. Not a string (``str(tensor)`` under vmap shows every replica's
    data), nor any other object (it might hold a tensor)."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return True
    if type(value) in (list, tuple):
        return all(_plain_numbers(item) for item in value)
    if type(value) is dict:
        return all(isinstance(key, (str, int)) and _plain_numbers(item) for key, item in value.items())
    return False


def _device_of(stack: ReplicaStack) -> torch.device:
    return stack.buckets[0].center.device if stack.buckets else torch.device("cpu")


_AUTOGRAD_BACKWARD = torch.autograd.backward.__code__


def raised_inside_autograd(error: BaseException) -> bool:
    """Whether ``error`` was raised while ``torch.autograd.backward`` ran (not in a hook before or after it): an
    error of the fused backward, after which a step may run again on the sequential engine."""
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is _AUTOGRAD_BACKWARD:
            return True
        frame = frame.tb_next
    return False


def reported_as_mean(total: Tensor, losses: Tensor, skipped: Optional[Tensor]) -> Tensor:
    """``total``, the sum of the replicas' losses, carrying the value of their mean: the step's loss that
    Lightning hands to hooks and callbacks (``outputs["loss"]``), as plain Lightning hands a batch's loss.
    The gradient is the sum's, unchanged (the added term is a constant): each replica still gets the
    gradient of its own loss. Replicas that skipped the step (``skipped``; None: none) are not counted.

    ``total - value`` is an exact zero for a finite sum (so the mean is rounded once, also in bfloat16); for a
    non-finite one, ``value`` made finite keeps it ``±inf`` or NaN, which the mean then is too."""
    if losses.numel() == 1:
        return total
    stepped = losses.numel() if skipped is None else int((~skipped).sum())
    value = total.detach()  # (the sum of ``losses``, in which the replicas that skipped count 0)
    return (total - value.nan_to_num()) + value / stepped
