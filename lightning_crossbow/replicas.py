"""ReplicaStack: the k replicas of a module's parameters and buffers as stacked tensors.

Trainable parameters of one dtype and device share one flat buffer ``replicas`` of shape
``(k, N)``: row ``j`` is replica ``j``, and every parameter of replica ``j`` is a view into that row.
The optimizer sees, per parameter, one leaf tensor of shape ``(k, *p.shape)`` (a view of the flat
buffer), so one element-wise optimizer over the stack is ``k`` independent optimizers. The module's
own parameters are re-bound as views of the flat ``center`` buffer: they ARE the central model z,
and the SMA update is a few whole-buffer operations (see :mod:`lightning_crossbow.sma`).

Buffers (BatchNorm running statistics, ...) are stacked per buffer, ``(k, *b.shape)``, one set of
statistics per replica; the module's own buffers receive their mean on :meth:`sync_center_buffers_`, and a change
that code outside the step makes to one of them goes to every replica (:meth:`take_center_buffer_changes_`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Collection, Optional

import torch
from torch import Tensor, nn

from lightning_crossbow.stateless import slot_of
from lightning_crossbow.validation import check_int

BufferReducer = Callable[[Tensor], Tensor]


def rows_of(stacked: Tensor) -> Tensor:
    """``stacked`` ``(k, *shape)`` as ``(k, prod(shape))``: one row per replica (scalars and empty tensors too)."""
    return stacked.reshape(stacked.shape[0], math.prod(stacked.shape[1:]))


def resize_rows(stacked: Tensor, num_rows: int, fill: Optional[Tensor] = None) -> Tensor:
    """``stacked`` (rows = replicas) with ``num_rows`` rows: the first ones kept, the new ones ``fill``.

    ``fill`` defaults to the mean of the existing rows (floating point) or row 0 (other dtypes).
    """
    if fill is None:
        fill = stacked.mean(0) if stacked.is_floating_point() else stacked[0]
    resized = fill.unsqueeze(0).repeat(num_rows, *([1] * fill.dim()))
    kept = min(stacked.shape[0], num_rows)
    resized[:kept] = stacked[:kept]
    return resized


def _every_learner_takes_center(bucket: FlatBucket, start: int, end: int) -> None:
    """Every replica's, and z_prev's, elements ``start:end`` of ``bucket`` <- z's."""
    bucket.replicas[:, start:end] = bucket.center[start:end]
    bucket.center_prev[start:end] = bucket.center[start:end]


@dataclass
class FlatBucket:
    """Parameters of one dtype and device, flattened: ``center`` is z, row j of ``replicas`` is w_j."""

    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    center: Tensor  # (N,)
    center_prev: Tensor  # (N,)
    replicas: Tensor  # (k, N)
    corrections: Tensor  # (k, N), scratch: c_j = alpha (w_j - z) (SMA, EASGD) or d_j = w_j - z (scaled averaging)

    def slices(self) -> list[tuple[str, int, int, torch.Size]]:
        """``(name, start, end, shape)`` of every parameter's span in the flat ``(N,)`` buffers."""
        return [
            (name, start, start + shape.numel(), shape)
            for name, start, shape in zip(self.names, self.offsets, self.shapes)
        ]


class RowsReached:
    """Which replicas' backward reached each stacked parameter, over an optimizer step's backwards.

    In plain Lightning a parameter that a step's loss does not depend on has no gradient (``grad is None``) and
    the optimizer skips it: no weight decay, momentum or moments move it. A replica's gradient is a row of its
    stack's gradient, zero where that replica's backward did not reach it, and the optimizer would step it. Only
    the replicas run one by one can differ (a branch on the data); each stack's per-replica views come from one
    ``unbind``, whose backward node receives ``None`` for the rows no replica's loss depends on: a hook on it notes
    the rows reached (:meth:`watch`), and the rows that no backward of the step reached are held out of the
    optimizer's step (:class:`~lightning_crossbow.optim.HeldRows`)."""

    def __init__(self) -> None:
        self._reached: dict[str, list[bool]] = {}  # (per stack that a backward reached: its rows reached)

    def watch(self, views: dict[str, Tensor]) -> None:
        """Notes the rows that the next backward through ``views`` (one replica's views, from one ``unbind`` per
        stack: the node they share) reaches."""
        for name, view in views.items():
            if view.grad_fn is not None:
                view.grad_fn.register_prehook(partial(self._note, name))

    def _note(self, name: str, grads: tuple[Optional[Tensor], ...]) -> None:
        reached = [grad is not None for grad in grads]
        before = self._reached.get(name)
        self._reached[name] = reached if before is None else [a or b for a, b in zip(before, reached)]

    def unreached(self) -> dict[str, list[bool]]:
        """Per stack that some backward reached, its rows that none did (True), where there are any."""
        return {name: [not row for row in rows] for name, rows in self._reached.items() if not all(rows)}

    def resize(self, num_rows: int) -> None:
        """The stacks now have ``num_rows`` rows, the first ones kept (a change of k within an accumulation window):
        the new rows were reached by no backward so far."""
        for name, rows in self._reached.items():
            self._reached[name] = (rows + [False] * num_rows)[:num_rows]

    def clear(self) -> None:
        """Forgets what the backwards so far reached (an optimizer step begins)."""
        self._reached.clear()


class ReplicaStack:
    """``k`` replicas of ``module``'s trainable parameters and buffers, all starting as copies of it.

    After construction the module's trainable parameters are views of the central buffers, so
    anything that reads the module (validation, checkpoints, callbacks) reads z.
    """

    def __init__(self, module: nn.Module, num_replicas: int) -> None:
        check_int("num_replicas", num_replicas)
        lazy = [
            name
            for name, tensor in (*module.named_parameters(), *module.named_buffers())
            if isinstance(tensor, nn.parameter.UninitializedTensorMixin)
        ]
        if lazy:
            raise ValueError(
                f"crossbow cannot replicate {', '.join(lazy)}: uninitialized (a lazy module's, such as nn.LazyLinear),"
                " their shapes are known only after a first forward. Run the module once on an example batch before"
                " fit (in its __init__ or setup), or give the layers their input sizes."
            )
        self.num_replicas = num_replicas
        #: The rows of each stacked parameter that the optimizer step's backwards reached (see :meth:`unbind`).
        self.rows_reached = RowsReached()
        self.buckets: list[FlatBucket] = []
        self.params: dict[str, Tensor] = {}
        self._module_params: list[list[nn.Parameter]] = []  # per bucket
        self._held: set[str] = set()  #: parameters frozen during training, held as they are
        #: Every parameter with replicas, and its span ``(name, bucket, start, end)`` in the flat buffers.
        self._trainable_params: list[nn.Parameter] = []
        self._trainable_spans: list[tuple[str, FlatBucket, int, int]] = []
        self._flags_seen: tuple[bool, ...] = ()  #: their requires_grad when last followed
        self._add_buckets([(name, param) for name, param in module.named_parameters() if param.requires_grad])
        self.buffers: dict[str, Tensor] = {
            name: buf.detach().unsqueeze(0).repeat(num_replicas, *([1] * buf.dim()))
            for name, buf in module.named_buffers()
        }
        #: Where each of z's buffers (the module's own) lives: its owning module and attribute (looked up once).
        self._center_buffer_slots: dict[str, tuple[nn.Module, str]] = {}
        for name in self.buffers:
            owner, _, attribute = slot_of(module, name)
            self._center_buffer_slots[name] = (owner, attribute)
        #: Each of z's buffers as last written or taken by this stack, and its version then.
        self._center_buffers_seen: dict[str, tuple[Tensor, int]] = {}
        self.note_center_buffers()
        self._bind_center(module)

    def _add_buckets(self, members: list[tuple[str, nn.Parameter]]) -> list[FlatBucket]:
        """New flat buckets (one per dtype and device) holding ``members``, every replica a copy of each; their
        stacked leaves join :attr:`params`. Returns the new buckets."""
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, param in members:
            groups.setdefault((param.dtype, param.device), []).append((name, param))
        added = []
        for grouped in groups.values():
            center = torch.cat([p.detach().reshape(-1) for _, p in grouped])
            offsets, start = [], 0
            for _, p in grouped:
                offsets.append(start)
                start += p.numel()
            replicas = center.unsqueeze(0).repeat(self.num_replicas, 1)
            bucket = FlatBucket(
                names=[n for n, _ in grouped],
                shapes=[p.shape for _, p in grouped],
                offsets=offsets,
                center=center,
                center_prev=center.clone(),
                replicas=replicas,
                corrections=torch.empty_like(replicas),
            )
            self.buckets.append(bucket)
            self._module_params.append([p for _, p in grouped])
            self._trainable_params += self._module_params[-1]
            self._flags_seen += tuple(param.requires_grad for param in self._module_params[-1])  # (leaves made so)
            self._trainable_spans += [(name, bucket, start, end) for name, start, end, _ in bucket.slices()]
            self._make_param_views(bucket, self._module_params[-1])
            added.append(bucket)
        return added

    def add_replicas_(self, module: nn.Module, names: list[str]) -> None:
        """Gives replicas to ``module``'s parameters ``names`` (ones that had none: frozen when the stack was made),
        each a copy of the parameter, in new buckets; the module's parameters become views of their z. The
        leaves already in :attr:`params` stay the same tensors (the optimizer state over them stays valid)."""
        already = [name for name in names if name in self.params]
        if already:
            raise ValueError(f"{', '.join(already)} already have replicas.")
        self._bind_center(module, self._add_buckets([(name, module.get_parameter(name)) for name in names]))

    # ----------------------------------------------------------------------------------- views
    def _make_param_views(self, bucket: FlatBucket, module_params: list[nn.Parameter]) -> None:
        """The stacked ``(k, *shape)`` leaves of ``bucket``'s parameters, views of its replicas, into :attr:`params`."""
        for (name, start, end, shape), param in zip(bucket.slices(), module_params, strict=True):
            leaf = bucket.replicas[:, start:end].view(self.num_replicas, *shape).detach()
            self.params[name] = leaf.requires_grad_(param.requires_grad)  # (a parameter frozen since: see below)

    @torch.no_grad()
    def follow_requires_grad_(self, hold: bool, at_mean: bool = False) -> None:
        """Each stacked leaf's ``requires_grad`` follows its module parameter's: a parameter frozen during training
        gets no more gradients, and one unfrozen again does. With ``hold`` (an optimizer step's start), a frozen
        parameter not yet held is held: its replicas are set to z (``at_mean``: to their mean, for rules that keep
        no z during training), z_prev to z, and its gradient is dropped, so that neither the optimizer nor any
        averaging rule moves it (it stays as it is, as in plain Lightning). Between two accumulated batches, a
        parameter frozen keeps the gradient it accumulated, which the step still takes, as in plain Lightning.
        Called at every batch: when no flag changed and nothing waits to be held, it only reads the flags."""
        flags = tuple(param.requires_grad for param in self._trainable_params)
        if flags == self._flags_seen and not (hold and len(self._held) < flags.count(False)):
            return
        self._flags_seen = flags
        for (name, bucket, start, end), trained in zip(self._trainable_spans, flags):
            leaf = self.params[name]
            if leaf.requires_grad != trained:
                leaf.requires_grad_(trained)
            if trained:
                self._held.discard(name)
            elif hold and name not in self._held:
                rows = bucket.replicas[:, start:end]
                rows.copy_((rows.mean(0) if at_mean else bucket.center[start:end]).expand_as(rows))
                bucket.center_prev[start:end] = bucket.center[start:end]
                leaf.grad = None
                self._held.add(name)

    def _bind_center(self, module: nn.Module, buckets: Optional[list[FlatBucket]] = None) -> None:
        """Makes ``module``'s parameters with replicas (those of ``buckets``: all when None) views of the central
        buffers (z)."""
        for bucket in self.buckets if buckets is None else buckets:
            for name, start, end, shape in bucket.slices():
                module.get_parameter(name).data = bucket.center[start:end].view(shape)

    @torch.no_grad()
    def release_center(self) -> None:
        """Gives every module parameter that is still a view of a central buffer a storage of its own, holding its
        value (after fit: a parameter saved or kept alone then holds itself, not its whole bucket)."""
        for bucket, params in zip(self.buckets, self._module_params, strict=True):
            center = bucket.center.untyped_storage().data_ptr()
            for param in params:
                if param.untyped_storage().data_ptr() == center:
                    param.data = param.data.clone()

    def is_bound(self, every_parameter: bool = False) -> bool:
        """Whether the module's parameters still live in the central buffers (``.to()`` breaks this). ``.to()`` and
        ``_apply`` replace every parameter's data at once, so one parameter per bucket tells; ``every_parameter``
        checks each one's place (a new tensor given to one parameter's ``.data``)."""
        if not every_parameter:
            return all(
                params[0].untyped_storage().data_ptr() == bucket.center.untyped_storage().data_ptr()
                for bucket, params in zip(self.buckets, self._module_params)
            )
        return all(
            param.data_ptr() == bucket.center[start:end].data_ptr() and param.shape == shape
            for bucket, params in zip(self.buckets, self._module_params)
            for param, (_, start, end, shape) in zip(params, bucket.slices())
        )

    def rebind_(self, module: nn.Module) -> None:
        """Takes the module's current parameter values as z and re-binds them to the central buffers."""
        for bucket in self.buckets:
            for name, start, end, _ in bucket.slices():
                bucket.center[start:end].copy_(module.get_parameter(name).detach().reshape(-1))
        self._bind_center(module)

    def unbind(self) -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
        """All replicas' parameters and buffers, one ``unbind`` per stacked tensor; the rows of each parameter that
        their backward reaches go into :attr:`rows_reached`."""
        if self.num_replicas == 1:  # a view whose backward is a reshape, not a stack of gradients
            return [
                ({n: t.squeeze(0) for n, t in self.params.items()}, {n: t.squeeze(0) for n, t in self.buffers.items()})
            ]
        params = {name: stack.unbind(0) for name, stack in self.params.items()}
        buffers = {name: stack.unbind(0) for name, stack in self.buffers.items()}
        replicas = [
            ({n: t[j] for n, t in params.items()}, {n: t[j] for n, t in buffers.items()})
            for j in range(self.num_replicas)
        ]
        self.rows_reached.watch(replicas[0][0])
        return replicas

    def state_bytes_per_replica(self) -> int:
        """Bytes one more replica holds outside its activations: weights, gradients, two optimizer states and
        the corrections, five copies of the trainable parameters."""
        return 5 * sum(b.replicas[0].numel() * b.replicas.element_size() for b in self.buckets)

    @torch.no_grad()
    def divergence(self) -> Tensor:
        """``mean_j ||w_j - z|| / ||z||`` over the local replicas (all parameters as one vector)."""
        squared_diff = sum(((b.replicas - b.center) ** 2).sum(1) for b in self.buckets)
        squared_center = sum((b.center**2).sum() for b in self.buckets)
        return (squared_diff.sqrt() / squared_center.sqrt().clamp(min=1e-12)).mean()

    # ------------------------------------------------------------------------------- updates
    @torch.no_grad()
    def gather_replicas_at_their_mean_(self) -> None:
        """Sets every local replica's parameters to the local replicas' mean."""
        for bucket in self.buckets:
            bucket.replicas.copy_(bucket.replicas.mean(0, keepdim=True).expand_as(bucket.replicas))

    def release_gradients_(self) -> None:
        """Drops every stacked parameter's gradient (``grad = None``), as ``zero_grad()`` drops a module's."""
        for leaf in self.params.values():
            leaf.grad = None

    @torch.no_grad()
    def reset_replicas_(self, module: nn.Module, rows: Optional[Tensor] = None, buffers: bool = False) -> None:
        """Sets replicas ``rows`` (a bool mask; all when None) to z, and their buffers to z's if asked."""
        for bucket in self.buckets:
            if rows is None:
                bucket.replicas.copy_(bucket.center.expand_as(bucket.replicas))
            else:
                bucket.replicas[rows] = bucket.center
        if buffers:
            self.reset_buffers_(module, rows)

    @torch.no_grad()
    def reset_buffers_(self, module: nn.Module, rows: Optional[Tensor] = None) -> None:
        """Sets the buffers of replicas ``rows`` (a bool mask; all when None) to z's (``module``'s own)."""
        for name, stack in self.buffers.items():
            center = module.get_buffer(name)
            if rows is None:
                stack.copy_(center.expand_as(stack))
            else:
                stack[rows] = center

    def note_center_for_shifts(self) -> None:
        """Notes z as it is now (a copy): what :meth:`take_center_shift_` compares against."""
        self._center_at_averaging: Optional[list[Tensor]] = [bucket.center.clone() for bucket in self.buckets]

    @torch.no_grad()
    def take_center_shift_(self) -> bool:
        """Every learner moves by what z moved since :meth:`note_center_for_shifts`, ``w_j <- w_j + (z - z_noted)``:
        a change that a hook or callback made to the weights between two averagings (``averaging_period > 1``,
        where the learners do not restart from z), which the next averaging, measuring ``d_j = w_j - z``, would
        otherwise undo by the outer learning rate. Compared by value (a write through a parameter, whose ``.data``
        is a view of z, does not reach z's version counter); notes z again; returns whether it had moved."""
        noted = getattr(self, "_center_at_averaging", None)
        if noted is None or len(noted) != len(self.buckets):  # (none noted: a resume between two averagings)
            self.note_center_for_shifts()
            return False
        moved = False
        for bucket, before in zip(self.buckets, noted):
            if not torch.equal(bucket.center, before):
                bucket.replicas.add_(bucket.center - before)
                before.copy_(bucket.center)
                moved = True
        return moved

    def note_center_params(self) -> None:
        """Notes z's parameters with replicas as they are now (a copy, until :meth:`take_center_param_changes_`)."""
        self._center_seen: Optional[list[Tensor]] = [bucket.center.clone() for bucket in self.buckets]

    @torch.no_grad()
    def take_center_param_changes_(self, module: nn.Module) -> list[str]:
        """Every replica, and z's previous value (its momentum's), take z's value of each parameter whose value
        changed since :meth:`note_center_params` (in place, through ``.data``, or by a new tensor given to ``.data``,
        which z then takes): weights that a hook set after the replicas were made (an initialisation or a warm start
        in ``on_fit_start``), which the learners of rules that keep them apart (``sma``, ``easgd``, gossip) start
        from, as plain Lightning trains from them. Drops the copy; returns the names."""
        seen, self._center_seen = getattr(self, "_center_seen", None), None
        if seen is None:
            return []
        if not self.is_bound(every_parameter=True):
            self.rebind_(module)  # (z takes the module's values)
        changed = []
        for bucket, before in zip(self.buckets, seen):  # (buckets added since are made from z)
            for name, start, end, _ in bucket.slices():
                if not torch.equal(bucket.center[start:end], before[start:end]):
                    _every_learner_takes_center(bucket, start, end)
                    changed.append(name)
        return changed

    @torch.no_grad()
    def take_center_values_(self, names: Collection[str]) -> list[str]:
        """Every replica (and z's previous value) takes z's value of each parameter and buffer named in ``names``:
        entries of a checkpoint that a hook edited after the replicas' own copies were saved (``on_load_checkpoint``
        resetting a head, say), as plain Lightning trains from the edited values. Returns the names taken."""
        taken = []
        for bucket in self.buckets:
            for name, start, end, _ in bucket.slices():
                if name in names:
                    _every_learner_takes_center(bucket, start, end)
                    taken.append(name)
        for name in self.buffers:
            if name in names and (buf := self._center_buffer(name)) is not None:
                self._every_replica_takes_buffer(name, buf)
                taken.append(name)
        if taken:
            self.note_center_buffers()
        return taken

    def _center_buffer(self, name: str) -> Optional[Tensor]:
        """z's buffer ``name``, as the module holds it now (None where it was set to None)."""
        owner, attribute = self._center_buffer_slots[name]
        return owner._buffers.get(attribute)

    def note_center_buffers(self) -> None:
        """Notes z's buffers as they are now: what :meth:`take_center_buffer_changes_` compares against."""
        self._center_buffers_seen = {
            name: (buf, buf._version) for name in self.buffers if (buf := self._center_buffer(name)) is not None
        }

    @torch.no_grad()
    def take_center_buffer_changes_(self) -> list[str]:
        """Every replica takes z's value of each buffer that changed since this stack last wrote or took z's buffers:
        one that a hook or callback changed (a step counter, an annealed temperature, an ``AveragedModel``'s
        ``n_averaged``), in place or by assigning a new tensor, keeps its new value from then on, as the module's own
        buffer keeps it in plain Lightning, where the replicas' mean would otherwise overwrite it. Returns their
        names. (A version counter and an identity per buffer: nothing is compared value by value.)"""
        taken = []
        for name in self.buffers:
            buf = self._center_buffer(name)
            seen = self._center_buffers_seen.get(name)
            if buf is None or (seen is not None and buf is seen[0] and buf._version == seen[1]):
                continue  # (unchanged; or set to None, where the replicas keep theirs)
            self._every_replica_takes_buffer(name, buf)
            taken.append(name)
        if taken:
            self.note_center_buffers()
        return taken

    def _every_replica_takes_buffer(self, name: str, buf: Tensor) -> None:
        """Every replica's buffer ``name`` <- ``buf`` (z's), in place, or anew where it has another shape or dtype."""
        stack = self.buffers[name]
        if buf.shape == stack.shape[1:] and buf.dtype == stack.dtype and buf.device == stack.device:
            stack.copy_(buf.expand_as(stack))
        else:  # (assigned anew, in another shape or dtype)
            self.buffers[name] = buf.detach().unsqueeze(0).repeat(self.num_replicas, *([1] * buf.dim()))

    @torch.no_grad()
    def sync_center_buffers_(self, all_reduce_mean: Optional[BufferReducer] = None) -> None:
        """z's buffers <- the mean over all replicas: one mean over the replicas of every buffer of a dtype flattened
        together, and across processes one ``all_reduce_mean`` of it. Integer and boolean buffers (BatchNorm's
        ``num_batches_tracked``) take the mean rounded to the nearest integer (half to even), so that every
        process's z holds the same count: on one process exactly, as replica 0's value plus the rounded mean of the
        others' differences from it (a value beyond float64's 2^53, a seed or a packed id, stays as it is); across
        processes averaged in float64 (exact below 2^53). Other buffers (complex) take replica 0's. A buffer of z
        that changed since it was last written (:meth:`take_center_buffer_changes_`) is first taken by every
        replica: its mean is then that value."""
        self.take_center_buffer_changes_()
        averaged: dict[torch.dtype, list[str]] = {}
        others: list[str] = []
        integers: list[str] = []
        for name, stack in self.buffers.items():
            if stack.is_floating_point():
                averaged.setdefault(stack.dtype, []).append(name)
            elif stack.is_complex():
                others.append(name)
            elif all_reduce_mean is None:
                integers.append(name)
            else:
                averaged.setdefault(torch.float64, []).append(name)
        if integers:
            self._take_integer_means(integers)
        if others:
            torch._foreach_copy_([self._center_buffer(n) for n in others], [self.buffers[n][0] for n in others])
        for dtype, names in averaged.items():
            means = torch.cat([rows_of(self.buffers[name]).to(dtype) for name in names], dim=1).mean(0)
            if all_reduce_mean is not None:
                means = all_reduce_mean(means)
            targets = [self._center_buffer(name) for name in names]
            parts = means.split([target.numel() for target in targets])
            torch._foreach_copy_(
                targets,
                [
                    (part if target.is_floating_point() else part.round()).view_as(target)
                    for part, target in zip(parts, targets, strict=True)
                ],
            )
        self.note_center_buffers()

    def _take_integer_means(self, names: list[str]) -> None:
        """z's integer buffers ``names`` <- their replicas' means, rounded, exactly, all flattened together: replica
        0's value plus the rounded mean of the differences from it (in float64: exact while the replicas differ by
        less than 2^53)."""
        names = [name for name in names if self._center_buffer(name) is not None]
        if not names:
            return
        rows = torch.cat([rows_of(self.buffers[name]).long() for name in names], dim=1)
        means = rows[0] + (rows - rows[0]).double().mean(0).round().long()
        targets = [self._center_buffer(name) for name in names]
        parts = means.split([target.numel() for target in targets])
        torch._foreach_copy_(targets, [part.view_as(target) for part, target in zip(parts, targets, strict=True)])

    @torch.no_grad()
    def resize_(self, num_replicas: int) -> None:
        """Keeps replicas ``0 .. min(k, k_new) - 1``; each new replica is a copy of z.

        New replicas' buffers are the mean of the existing replicas' (floating point; integer
        buffers copy replica 0's). z, z_prev and the module's binding to z are untouched; the
        per-parameter leaves in :attr:`params` are new tensors (re-point the optimizer at them).
        """
        check_int("num_replicas", num_replicas)
        for bucket in self.buckets:
            bucket.replicas = resize_rows(bucket.replicas, num_replicas, fill=bucket.center)
            bucket.corrections = torch.empty_like(bucket.replicas)
        self.buffers = {name: resize_rows(stack, num_replicas) for name, stack in self.buffers.items()}
        self.rows_reached.resize(num_replicas)
        self.num_replicas = num_replicas
        self.params = {}
        for bucket, module_params in zip(self.buckets, self._module_params, strict=True):
            self._make_param_views(bucket, module_params)

    # ---------------------------------------------------------------------------- state dict
    @property
    def layout(self) -> list[list[str]]:
        """The names of the parameters with replicas, bucket by bucket (the flat buffers' layout)."""
        return [list(bucket.names) for bucket in self.buckets]

    def state_dict(self) -> dict[str, Any]:
        """The replicas, their buffers and z_prev, and the layout they are in, for checkpoints."""
        return {
            "num_replicas": self.num_replicas,
            "names": self.layout,
            "replicas": [b.replicas.detach().cpu().clone() for b in self.buckets],
            "center_prev": [b.center_prev.detach().cpu().clone() for b in self.buckets],
            "buffers": {n: b.detach().cpu().clone() for n, b in self.buffers.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], replicas: bool = True) -> None:
        """Restores z_prev, and the replicas and their buffers too when ``replicas`` is True (the state must then
        have this stack's k and layout). z_prev is restored parameter by parameter, by name, where the state's
        layout differs from this stack's (a parameter that had no replicas in the state keeps its own)."""
        layout = state.get("names", self.layout)  # (a state written before layouts were saved: this one's)
        if layout == self.layout:
            for bucket, prev in zip(self.buckets, state["center_prev"], strict=True):
                bucket.center_prev.copy_(prev)
        else:
            saved = {}
            for names, prev in zip(layout, state["center_prev"], strict=True):
                sizes = [self.params[name][0].numel() if name in self.params else 0 for name in names]
                if sum(sizes) == prev.numel():  # (else the module changed: nothing of it is taken)
                    saved.update(zip(names, prev.split(sizes)))
            for name, bucket, start, end in self._trainable_spans:
                if name in saved:
                    bucket.center_prev[start:end] = saved[name]
        if not replicas:
            return
        if state["num_replicas"] != self.num_replicas or layout != self.layout:
            raise ValueError(
                f"State has {state['num_replicas']} replicas of {layout}, this stack {self.num_replicas} of"
                f" {self.layout}."
            )
        for bucket, saved_rows in zip(self.buckets, state["replicas"], strict=True):
            bucket.replicas.copy_(saved_rows)
        for name, saved_buffer in state["buffers"].items():
            self.buffers[name].copy_(saved_buffer)


class BufferSnapshot:
    """A copy of a stack's buffers (BatchNorm's running statistics, ...), taken before a step that may have
    to be undone and written back by :meth:`restore_`. The copies are kept from step to step: :meth:`take`
    is one foreach copy, allocating again only for another stack or k (the only things that reshape them)."""

    def __init__(self) -> None:
        self._copies: list[Tensor] = []
        self._shaped_for: Optional[tuple[int, int]] = None  # (the stack, its k)

    def take(self, stack: ReplicaStack) -> None:
        buffers = list(stack.buffers.values())
        if self._shaped_for != (id(stack), stack.num_replicas):
            self._copies = [b.detach().clone() for b in buffers]
            self._shaped_for = (id(stack), stack.num_replicas)
        elif buffers:
            torch._foreach_copy_(self._copies, buffers)

    def restore_(self, stack: ReplicaStack) -> None:
        """Writes the copies back into ``stack``, which must have the k they were taken at."""
        if self._shaped_for != (id(stack), stack.num_replicas):
            raise RuntimeError("BufferSnapshot.restore_: the stack was resized after the snapshot was taken.")
        if self._copies:
            with torch.no_grad():
                torch._foreach_copy_(list(stack.buffers.values()), self._copies)

    def clear(self) -> None:
        self._copies, self._shaped_for = [], None
