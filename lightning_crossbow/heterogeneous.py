r"""Heterogeneous mode's layouts of learners over one fit, on one rank: which is in force, which are scheduled.

A *layout* is the learners on each rank, the split ``(k_0, ..., k_{R-1})``, and each rank's per-replica batch
size ``b_r`` (:class:`~lightning_crossbow.routing.Layout`). One fit starts at an even split at the DataLoader's
batch size. The :class:`~lightning_crossbow.balancing.SpeedBalancer`'s windows, and a new k
(``set_replicas_per_device``), schedule new layouts in the :class:`~lightning_crossbow.routing.RoutingPlan` from a
group of the common order that no rank has drawn yet; each comes in force when the training loop reaches that
group, on every rank at the same step. From the layout in force follow:

- Adaptive SGD's normalized merge, ``K p_i`` per local learner with ``p_i = b_i / sum_j b_j`` (``b_i`` learner
  ``i``'s samples since the last averaging; :meth:`LearnerLayouts.learner_weights`);
- with ``SpeedBalancer(lr_follows_batch=True)``, the local step's learning rate ``lr b_r / b``
  (:meth:`LearnerLayouts.learning_rate_scale`).

A checkpoint keeps the layout in force and the one scheduled (:meth:`LearnerLayouts.checkpoint_entries`); a resume
carries them on (:meth:`LearnerLayouts.restore`). The strategy keeps what the layouts act on: the replicas, the
loader, Lightning's count of the epoch's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_crossbow.balancing import SpeedBalancer
from lightning_crossbow.data import RoutedBatchLoader
from lightning_crossbow.routing import Layout, RoutingPlan, Split, full_batch_weights, skips_too_much


class LearnerLayouts:
    """This rank's heterogeneous mode during one fit: the routing plan, the layout in force at the step in progress
    (the last one; before a fit's first step, the checkpoint's or the first), and the balancer that schedules the
    next ones. Made when a fit sets up, dropped when it ends."""

    def __init__(self, balancer: SpeedBalancer, replicas_per_device: int, world_size: int, rank: int) -> None:
        self.balancer = balancer
        self.rank = rank
        self.plan = RoutingPlan((replicas_per_device,) * world_size, rank)
        self.split: Split = self.plan.latest  #: the learners per rank at the step in progress
        #: each rank's per-replica batch size at the step in progress where one differs from the DataLoader's
        #: (``SpeedBalancer(max_batch_scale > 1)``); None: the DataLoader's on every rank (as the plan keeps them)
        self.batch_sizes: Optional[Split] = None
        #: the DataLoader batch size that a restored checkpoint's batch sizes were sized for, until the loader is made
        self.restored_batch_base: Optional[int] = None
        balancer.restart()
        balancer.history = [(0, self.split, None)]

    # ------------------------------------------------------------------------------ in force
    def layout_in_force(self) -> Layout:
        """The learners per rank and their per-replica batch sizes at the step in progress."""
        return Layout(self.split, self.batch_sizes or (self.plan.batch_size,) * len(self.split))

    def own_batch_size(self) -> int:
        """This rank's per-replica batch size at the step in progress."""
        return self.layout_in_force().batch_sizes[self.rank]

    def put_in_force(self, layout: Layout) -> None:
        """``layout`` is the one of the step that starts (its group's, :meth:`RoutingPlan.layout_at`)."""
        self.split, self.batch_sizes = layout.split, self.plan.scaled(layout.batch_sizes)

    def change_scheduled(self) -> bool:
        """Whether a change of the split or batch sizes is scheduled and not in force yet."""
        return self.plan.latest_layout != self.layout_in_force()

    def learning_rate_scale(self) -> float:
        """``b_r / b`` for this rank's learners where the balancer gave them larger batches and their learning rate
        follows (``SpeedBalancer(lr_follows_batch=True)``), else 1."""
        if not self.balancer.lr_follows_batch:
            return 1.0
        return self.own_batch_size() / self.plan.batch_size

    def learner_weights(self, group: int, steps_since_averaging: int, pending: bool = False) -> Optional[list[float]]:
        """``K p_i`` of the local learners where the learners' samples since the last averaging differ (a short
        batch, or ranks' batch sizes that differ), else None: for ``group``'s step, the ``steps_since_averaging``-th
        since the last averaging; ``pending``: for the steps since the last averaging, averaged before the learners
        change (all of them steps of full batches at the layout in force)."""
        if pending:
            return full_batch_weights(self.layout_in_force(), self.rank)
        return self.plan.learner_weights(group, steps_since_averaging - 1)

    # ---------------------------------------------------------------------------- scheduled
    def schedule_k(self, num_learners: int, ranks: int, first_free_group: int, step: int) -> None:
        """A new k: ``num_learners`` learners split by the speeds measured last, from ``first_free_group`` (the
        first group no rank has drawn), at the DataLoader's batch size (the next window sizes the batches)."""
        split = self.balancer.split_for(num_learners, ranks)
        self.plan.schedule(split, first_free_group)
        self.balancer.history.append((step, split, None))

    def rebalance(
        self, loader: RoutedBatchLoader, room: int, all_gather: Callable[[Tensor], Tensor], step: int
    ) -> Optional[tuple[Layout, int]]:
        """Ends the balancer's window: every rank schedules the same new layout, if one pays, from the same group.
        Returns it and that group; None where nothing changes (also where another change, the tuner's, is
        scheduled and not in force yet, or where the new layout would leave out more of each epoch's samples)."""
        current = self.layout_in_force()
        if self.plan.latest_layout != current:
            self.balancer.restart()
            return None
        layout, first_free_group = self.balancer.rebalance(
            current, self.plan.batch_size, all_gather, self.plan.groups_drawn, room
        )
        if layout is None or skips_too_much(loader.routed_sampler, layout, current):
            return None
        self.plan.schedule(layout.split, first_free_group, layout.batch_sizes)
        self.balancer.history.append((step, layout.split, self.plan.latest_scaled_batch_sizes))
        return layout, first_free_group

    def report(self, layout: Layout, first_free_group: int, loader: RoutedBatchLoader) -> None:
        """Says what :meth:`rebalance` scheduled, before it is in force: the step models measured, the new layout,
        and the samples of this epoch and later ones that it leaves out (a warning over a tenth of an epoch)."""
        sampler, current = loader.routed_sampler, self.layout_in_force()
        left_out = loader.samples_left_out_of_pass()
        if left_out * 10 > sampler.samples_per_epoch():
            rank_zero_warn(
                f"crossbow: with the new learners per rank {layout.split} and per-replica batch sizes"
                f" {layout.batch_sizes}, the last {left_out} of this epoch's {sampler.samples_per_epoch()} samples fill"
                f" no step and are skipped (in later epochs {sampler.skipped_samples(layout)})."
            )
        models = ", ".join(
            f"{1e3 * m.fixed:.2f} + {1e3 * m.per_learner:.2f} u" for m in self.balancer.step_times() or ()
        )
        batches = ""
        if layout.batch_sizes != current.batch_sizes:
            batches = f", per-replica batch sizes {current.batch_sizes} -> {layout.batch_sizes}"
            batches += f" ({sampler.skipped_samples()} samples an epoch fill no step)"
        rank_zero_info(
            f"crossbow: busy ms per step by rank (u: learners x batch / DataLoader's batch): {models}; learners per"
            f" rank {current.split} -> {layout.split}{batches} from group {first_free_group} of the data order."
        )

    # --------------------------------------------------------------------------- checkpoints
    def checkpoint_entries(self, step_in_flight: bool) -> dict[str, Any]:
        """The layouts a checkpoint keeps: in force, and scheduled (with the groups between the first one not
        trained, which a resume trains first, and the one it starts at), and the DataLoader batch size the batch
        sizes were sized for. ``step_in_flight``: the last group handed out is not trained (its step did not end)."""
        scheduled = self.change_scheduled()
        untrained = self.plan.groups_trained - int(step_in_flight)
        return {
            "split": self.split,
            "next_split": (self.plan.latest, max(0, self.plan.latest_from - untrained)) if scheduled else None,
            "batch_sizes": self.batch_sizes,
            "batch_sizes_of_loader": self.plan.batch_size,
            "next_batch_sizes": self.plan.latest_scaled_batch_sizes if scheduled else None,
        }

    def restore(self, state: Mapping[str, Any], carries_on_k: bool, num_learners: int) -> Optional[Split]:
        """Carries on with the checkpoint's learners per rank (its split; a checkpoint of the uniform path holds an
        even one) when it has as many ranks and, unless ``carries_on_k`` (k tuned, or changed by hand in a fit
        made alike), ``num_learners`` in all, with a change of them it had scheduled; returns that split, or None
        where the fit starts at its own even split."""
        if state["world_size"] != len(self.split):
            return None
        ranks = state.get("ranks")
        balancer_state = ranks[self.rank].get("balancer") if ranks else None  # (None: an earlier version's)
        split = tuple(state["split"]) if state.get("split") else (state["replicas_per_device"],) * len(self.split)
        if sum(split) != num_learners and not carries_on_k:
            if balancer_state is not None:  # the speeds measured still hold: the first window starts from them
                self.balancer.load_state_dict(balancer_state, window=False)
            return None
        batch_sizes = tuple(state["batch_sizes"]) if state.get("batch_sizes") else None
        self.restored_batch_base = state.get("batch_sizes_of_loader")
        self.plan.restart(split, batch_sizes)
        self.split, self.batch_sizes = split, batch_sizes
        self.balancer.history = [(0, split, batch_sizes)]
        next_split, groups_before = state.get("next_split") or (None, 0)
        if next_split is not None and (sum(next_split) == sum(split) or carries_on_k):
            # A change scheduled and not in force yet goes on, as many groups after the first as it would have come
            # after the next one (a group drawn ahead and not trained may have put it later): the replicas follow
            # when its group arrives.
            next_sizes = tuple(state["next_batch_sizes"]) if state.get("next_batch_sizes") else None
            self.plan.schedule(tuple(next_split), groups_before, next_sizes)
            self.balancer.history.append((0, tuple(next_split), next_sizes))
        if balancer_state is not None:  # its models, its window so far, and its history, the change above included
            self.balancer.load_state_dict(balancer_state)
            if next_split is not None and not self.change_scheduled():
                self.balancer.history.pop()  # (the change it had scheduled does not go on)
        return split

    def check_restored_batch_sizes(self) -> None:
        """Once the DataLoader is made: a resume carries on the checkpoint's larger batches only with the DataLoader
        batch size they were sized for and within this balancer's ``max_batch_scale``; else its learners start at
        the DataLoader's batch size, with a warning, and the balancer's window starts afresh (with another DataLoader
        batch size, its measurements too)."""
        base, self.restored_batch_base = self.restored_batch_base, None
        if base is not None and base != self.plan.batch_size:  # (the balancer measured learner-batches of base)
            self.balancer.forget_measurements()
        sizes = self.plan.scaled_batch_sizes()
        if not sizes:
            return
        if base == self.plan.batch_size and max(max(entry) for entry in sizes) <= self.most_batch_size():
            return
        self.plan.forget_batch_sizes()
        self.batch_sizes = None
        self.balancer.restart()  # (its window measured the larger batches)
        rank_zero_warn(
            f"crossbow: the checkpoint's per-replica batch sizes {sizes[0]} were sized for a DataLoader batch size of"
            f" {base}; here it is {self.plan.batch_size} with max_batch_scale={self.balancer.max_batch_scale}, so"
            " every learner starts at the DataLoader's batch size and the balancer sizes them again."
        )

    def most_batch_size(self) -> int:
        """The largest per-replica batch size the balancer may give: ``floor(max_batch_scale x b)``."""
        return math.floor(self.balancer.max_batch_scale * self.plan.batch_size + 1e-9)
