"""CrossbowStrategy: Crossbow's k replicas per device and synchronous model averaging, in Lightning.

This module is the Strategy: Lightning's hooks, the checkpoint format, the out-of-memory back-off and the
checks before training. The pieces it wires together:

- :class:`~lightning_crossbow.data.ReplicaBatchLoader` groups k batches of the user's loader per step, and
  :class:`~lightning_crossbow.epoch_counts.EpochCounts` keeps Lightning's counts of the epoch right for them;
- :class:`~lightning_crossbow.replicas.ReplicaStack` holds the replicas; the LightningModule's own
  parameters are the central model z;
- :mod:`~lightning_crossbow.engines` run the user's ``training_step`` for all replicas;
- the user's optimizer steps every replica (:mod:`~lightning_crossbow.optim`);
- a rule of :mod:`~lightning_crossbow.algorithms` brings the replicas and z together, across
  processes through :mod:`~lightning_crossbow.collectives`.
"""

from __future__ import annotations

import atexit
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from types import MethodType
from typing import Any, ContextManager, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
)
from typing_extensions import override

from lightning_crossbow.accelerator import CrossbowAccelerator, device_memory, release_cached_memory
from lightning_crossbow.algorithms import (
    SMA,
    AlgorithmName,
    ScaledAveraging,
    StepContext,
    make_averaging,
    restart_stranded_,
)
from lightning_crossbow.balancing import SpeedBalancer
from lightning_crossbow.collectives import all_gather_rows, all_reduce_sum_, destroy_process_group_at_exit, pull_rows
from lightning_crossbow.data import (
    TRANSFER_HOOKS,
    ReplicaBatchLoader,
    ReplicaGroup,
    RoutedBatchLoader,
    group_as_it_is,
    loader_length,
    moved_tensors,
    on_before_batch_transfer_per_batch,
    saves_its_position,
    tensor_sequences,
)
from lightning_crossbow.engines import (
    ENGINES,
    STREAMS_NEED_CUDA,
    Engine,
    FastestEngine,
    SequentialEngine,
    make_engine,
    raised_inside_autograd,
    reported_as_mean,
)
from lightning_crossbow.epoch_counts import EpochCounts, ShowEpochCounts, limit_argument
from lightning_crossbow.gradients import MeanGradients, hooks_read_gradients
from lightning_crossbow.heterogeneous import LearnerLayouts
from lightning_crossbow.log_capture import LogCapture
from lightning_crossbow.optim import (
    HeldRows,
    central_state_dict,
    central_state_over_ranks,
    check_elementwise,
    checkpoint_marks,
    clip_grad_norm_per_replica_,
    edited,
    learning_rates_scaled,
    repoint_to_stack,
    reset_state_rows_,
    resize_stacked_state_,
    seed_stacked_state_,
    stacked_indices,
    stacked_params,
    take_central_settings_,
    take_edited_state_,
    unfuse_,
    with_learning_rates,
)
from lightning_crossbow.period import AveragePendingSteps, AveragingPeriod
from lightning_crossbow.preflight import (
    adapt_finetuning_callbacks,
    adapt_throughput_monitors,
    check_callbacks,
    warn_of_step_schedules_under_tuning,
)
from lightning_crossbow.replicas import BufferSnapshot, ReplicaStack, resize_rows
from lightning_crossbow.routing import Layout, RoutedBatchSampler, RoutingPlan, why_unroutable
from lightning_crossbow.sigterm import SigtermVote
from lightning_crossbow.streams import StreamPool
from lightning_crossbow.tuner import ReplicaAutoTuner
from lightning_crossbow.validation import check_int, check_lightning_arguments, optimizer_classes

#: An LR decrease between two consecutive steps counts as a "drop" (and resets the replicas to z
#: when ``reset_on_lr_drop``) when the new LR is at most this fraction of the old one and the old one
#: held for a step: step and plateau schedules drop by 0.1-0.5 at once after a plateau; a decay that
#: changes the LR every step (cosine, exponential, per-step) does not trigger it, even where it is steep.
LR_DROP_RATIO = 0.9

_ONE_OPTIMIZER = (
    "crossbow needs exactly one optimizer from configure_optimizers, got {count}: every replica runs its"
    " own copy of that one optimizer, and crossbow supports automatic optimization only."
)
_CHECKPOINT_KEY = "crossbow"
_CHECKPOINT_VERSION = 1


class CrossbowStrategy(DDPStrategy):
    r"""Trains ``k`` replicas of the LightningModule per device, kept together by synchronous model averaging.

    One optimizer step takes ``k`` consecutive batches of the training DataLoader per process (replica
    ``j`` the ``j``-th), steps every replica with the user's own optimizer (its own state per replica),
    and moves the central model z over all ``K = k x world_size`` learners by one of the rules of
    :mod:`lightning_crossbow.algorithms`. With the default, ``algorithm="scaled_averaging"``:

    .. math::

        d_j = \mathrm{opt\_step}(w_j) - z, \quad
        z \leftarrow z + \eta \tfrac{1}{K} \textstyle\sum_{j=1}^{K} d_j + \mu (z - z_{prev}), \quad w_j \leftarrow z

    with ``eta`` AdaScale's gain measured on the learners' steps (``outer_lr="adaptive"``). Crossbow's
    own rule is ``algorithm="sma"``:

    .. math::

        c_j = \alpha (w_j - z), \quad w_j \leftarrow \mathrm{opt\_step}(w_j) - c_j, \quad
        z \leftarrow z + \textstyle\sum_{j=1}^{K} c_j + \mu (z - z_{prev})

    z is the LightningModule's own parameters: validation, checkpoints and callbacks see z.

    Args:
        replicas_per_device: ``k``, the number of replicas (learners) per device, a positive int; or
            ``"auto"``: start at 1 and let a :class:`~lightning_crossbow.ReplicaAutoTuner` (added to the
            trainer's callbacks unless one is there) choose k from measured throughput (the default).
        alpha: ``sma`` and ``easgd`` only: correction strength in (0, 1]; ``None`` means ``1/K``.
        central_momentum: ``mu`` in [0, 1), momentum of the central model; ``None`` means 0.9 for ``sma``
            (Crossbow's value) and 0 otherwise (``easgd`` has none).
        algorithm: ``"scaled_averaging"`` (default), ``"sma"`` (Crossbow's rule, as published),
            ``"easgd"`` (elastic averaging SGD) or ``"gossip"``: see :mod:`lightning_crossbow.algorithms`.
        outer_lr: ``scaled_averaging`` only: ``"adaptive"`` (measured gain, default), ``"linear"`` (``K``;
            ``sqrt(K)`` for adaptive optimizers) or a positive number.
        warmup_epochs: ``scaled_averaging`` only: epochs over which the outer learning rate rises
            linearly from 1 (default 0: the adaptive gain warms up by itself).
        engine: ``"auto"`` (fused, falling back to sequential when the training_step cannot run under
            vmap; on CUDA, whichever of that and ``"streams"`` measures faster over the first steps),
            ``"fused"`` (torch.func.vmap over the stacked replicas), ``"sequential"`` (a loop), or
            ``"streams"`` (CUDA only: the loop with each replica on its own CUDA stream, and the averaging
            on a synchronisation stream; see :mod:`~lightning_crossbow.streams`).
        reset_on_lr_drop: reset every replica to z when the learning rate drops (see ``LR_DROP_RATIO``).
        heterogeneous: for devices of different speed (Adaptive SGD): ``True`` (or a
            :class:`~lightning_crossbow.SpeedBalancer` to configure) splits the ``K = replicas_per_device x
            world_size`` learners over the ranks so that the measured step times even out (during fit,
            ``replicas_per_device`` is this rank's own share); every rank takes its share of one common order
            of the data (:mod:`~lightning_crossbow.routing`), so an epoch still sees every sample once; z's
            update weighs each learner by its share of the step's samples. ``SpeedBalancer(max_batch_scale=s)``
            with ``s > 1`` also lets the faster ranks' learners take batches up to ``s`` times the DataLoader's
            where the split alone cannot balance the ranks. Every rank's DataLoader must be
            the whole dataset, with ``shuffle`` True or False. Off by default.
        averaging_period: ``H``, optimizer steps between two averagings (default 1: every step). Between them
            every learner takes its own steps and z stays as it is (local SGD); the rule then averages what they
            did. An averaging also ends every epoch and the last step of fit, and the steps since the last one are
            averaged before k or the split changes and where fit stops within an epoch. Across processes the
            all-reduce, z's buffers and the SIGTERM vote wait for the averaging: a larger ``H`` synchronises less
            (see :mod:`~lightning_crossbow.period`).
        elementwise_optimizers: optimizer classes, beyond torch's element-wise ones, that the user
            declares element-wise (each element updated from its own gradient and state only).
        The remaining arguments are those of Lightning's ``DDPStrategy`` (launching, backend, timeout).
    """

    strategy_name = "crossbow"

    def __init__(
        self,
        replicas_per_device: Union[int, Literal["auto"]] = "auto",
        alpha: Optional[float] = None,
        central_momentum: Optional[float] = None,
        algorithm: AlgorithmName = "scaled_averaging",
        outer_lr: Union[float, Literal["adaptive", "linear"]] = "adaptive",
        warmup_epochs: float = 0.0,
        engine: Literal["auto", "fused", "sequential", "streams"] = "auto",
        reset_on_lr_drop: bool = True,
        heterogeneous: Union[bool, SpeedBalancer] = False,
        averaging_period: int = 1,
        elementwise_optimizers: Iterable[type[Optimizer]] = (),
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.auto_replicas = replicas_per_device == "auto"
        if self.auto_replicas:
            replicas_per_device = 1
        else:
            check_int("replicas_per_device", replicas_per_device, note=" or 'auto'")
        self.averaging = make_averaging(algorithm, alpha, central_momentum, outer_lr, warmup_epochs)
        #: When the rule averages: every ``averaging_period`` optimizer steps, and where it must (see its module).
        self.period = AveragingPeriod(averaging_period)
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}.")
        if not isinstance(heterogeneous, (bool, SpeedBalancer)):
            raise ValueError(f"heterogeneous must be True, False or a SpeedBalancer, got {heterogeneous!r}.")
        if heterogeneous is not False and algorithm == "gossip":
            raise ValueError(
                "heterogeneous=True does not apply to algorithm='gossip': its peers are paired by position,"
                " which assumes the same number of learners on every rank. Use 'scaled_averaging', 'sma' or 'easgd'."
            )
        lightning_arguments = dict(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        check_lightning_arguments(lightning_arguments)
        super().__init__(**lightning_arguments)
        self.replicas_per_device = int(replicas_per_device)
        #: The k this strategy was made with (``replicas_per_device`` follows the changes made during fit).
        self._configured_replicas_per_device = self.replicas_per_device
        self.algorithm = algorithm
        self._alpha = None if alpha is None else float(alpha)
        self.central_momentum = self.averaging.central_momentum
        self.outer_lr = outer_lr
        self.warmup_epochs = float(warmup_epochs)
        self.engine_name = engine
        if not isinstance(reset_on_lr_drop, bool):
            raise ValueError(f"reset_on_lr_drop must be True or False, got {reset_on_lr_drop!r}.")
        self.reset_on_lr_drop = reset_on_lr_drop
        self.elementwise_optimizers = optimizer_classes(elementwise_optimizers)
        #: Splits the learners by speed in heterogeneous mode (None otherwise).
        self.balancer: Optional[SpeedBalancer] = (
            heterogeneous if isinstance(heterogeneous, SpeedBalancer) else SpeedBalancer() if heterogeneous else None
        )
        #: Heterogeneous mode's layouts of the learners during a fit (set up with the replicas, dropped after).
        self._layouts: Optional[LearnerLayouts] = None

        self.stack: Optional[ReplicaStack] = None
        self.engine: Optional[Engine] = None
        self._sequential_forwards: Optional[SequentialEngine] = None  # (see _forward_only_engine)
        self._step_call: tuple[Any, ...] = ()  # the arguments of the last training_step
        self._batch_starts_step = True  # whether that training_step's batch begins an optimizer step
        self._log_capture = LogCapture()
        self._step_losses: Optional[Tensor] = None
        self._step_skipped: Optional[Tensor] = None  # replicas whose training_step returned None this step
        self._gradients_pending = False  # see `accumulating`
        self._reads_gradients = False  # whether hooks read the module's gradients (set at set-up)
        self._mean_gradients: Optional[MeanGradients] = None
        self._last_lrs: Optional[list[float]] = None
        self._lrs_before_last: Optional[list[float]] = None
        self._center_stale = False
        self._final_state: Optional[dict[str, Any]] = None
        #: The module's state_dict when ``_final_state`` was kept: what the kept replicas belong to.
        self._center_after_fit: dict[str, Tensor] = {}
        self._leaves_after_fit: list[Tensor] = []  #: the stacked leaves the optimizer steps, kept at teardown
        #: The checkpoint being resumed from, as loaded, before hooks edit it (:func:`checkpoint_marks`).
        self._checkpoint_marks: Optional[dict[tuple[Any, ...], Any]] = None
        self._param_groups_seen = 0  #: the optimizer's param groups when last re-pointed at the replicas
        self._optimizer_seen: Optional[Optimizer] = None  #: the optimizer last re-pointed at the replicas
        self._unfused_groups: set[int] = set()  #: param groups made with fused=True that run without it
        #: Parameters without replicas: frozen when training started (they get them once unfrozen).
        self._without_replicas: list[tuple[str, torch.nn.Parameter]] = []
        self._step_started: Optional[float] = None
        self.samples_per_second: Optional[float] = None
        self._batch_size: Optional[int] = None
        self._grouped: Optional[ReplicaBatchLoader] = None
        #: Resume with the checkpoint's k instead of re-seeding (set when k is tuned, not fixed).
        self.restore_replicas_per_device = False
        #: The k of the training loader's first group on a resume whose checkpoint was taken after a change of k
        #: and before the group that makes it (None: ``replicas_per_device``).
        self._resumed_group_size: Optional[int] = None
        #: The k that :meth:`set_replicas_per_device` asked for, until the group that makes it arrives, else None.
        self._k_next_group: Optional[int] = None
        #: (groups, batches) of the epoch drawn before the checkpoint this fit resumes from (see
        #: :attr:`ReplicaBatchLoader.counts_on_resume`) until its training loader is made; None when not resuming.
        self._resumed_pass_counts: Optional[tuple[int, int]] = None
        #: The same, less a group whose step had not ended when the checkpoint was saved (saved from an exception in
        #: it): what a loader that does not save its place counts on from.
        self._resumed_pass_trained: Optional[tuple[int, int]] = None
        #: Heterogeneous mode: (epoch, groups, samples of the common order) of the epoch trained before the checkpoint
        #: this fit resumes from in that epoch's middle, until its routed loader is made (or told); else None.
        self._resumed_routed_place: Optional[tuple[int, int, int]] = None
        #: Heterogeneous mode: a fit resumed in an epoch's middle from a checkpoint without a place in the common
        #: order (of the uniform path), whose epoch draws its data from the order's start: warned at its first step.
        self._routed_place_unknown = False
        #: Whether the engine is running the user's training_step with the replicas' weights in the module (k > 1).
        self._replicas_in_module = False
        self._running_replica_steps = False  #: while the engine runs the replicas' training_step
        #: Whether the replicas' logs were replayed as training_step's in the batch in progress.
        self._training_step_logged = False
        #: Inside an optimizer step whose learning rates follow larger batches (lr_follows_batch): the param groups'
        #: own learning rates, which a checkpoint saved inside the step holds; else None.
        self._learning_rates_outside_step: Optional[list[float]] = None
        #: The training loader this fit made, once made.
        self._fit_loader: Optional[ReplicaBatchLoader] = None
        #: Lightning's counts of the training epoch, kept right for the groups of k batches.
        self._epoch = EpochCounts()
        #: The largest k known to fit in memory (set after an out-of-memory back-off), or None.
        self.replica_ceiling: Optional[int] = None
        self._group: Optional[list[Any]] = None  # the group of batches of the step in progress
        self._group_cut: Optional[int] = None  # how many of its batches run, after an out-of-memory back-off
        self._buffers_before_step = BufferSnapshot()  # undoes a step that ran out of memory (see _forward_backward)
        self._own_stream_pool: Optional[StreamPool] = None  # when the accelerator is not crossbow's
        #: engine="auto" on CUDA: the engine measured fastest at each k, so that a k seen before is not measured again.
        self._fastest_engine: dict[int, str] = {}
        self._engine_trial_step = False
        self._averaging_now = True  # whether the optimizer step in progress averages (see AveragingPeriod.due)
        self._average_at_step_end = False  # the learners changed within an accumulation window: average at its end
        self._lr_drop_pending = False  # a drop of the lr seen between two averagings: the replicas reset after the next
        self._transfer_per_batch = False  # set at set-up: whether the batch-transfer hooks are the user's own
        self._before_transfer_per_batch = False  # set at set-up: whether on_before_batch_transfer is the user's
        #: SIGTERM agreed in the averaging's all-reduce instead of Lightning's per-batch broadcast (multi-process fit).
        self._sigterm_vote = SigtermVote()

    # ------------------------------------------------------------------------------ properties
    @property
    def num_learners(self) -> int:
        """``K``, the learners over all processes: ``k x world_size``, or the sum of the split in heterogeneous mode."""
        if self._layouts is not None:
            return sum(self._layouts.split)
        return self.replicas_per_device * self.world_size

    @property
    def routing(self) -> Optional[RoutingPlan]:
        """Heterogeneous mode's routing of the common order of the data during a fit; None otherwise."""
        return self._layouts.plan if self._layouts is not None else None

    @property
    def layout(self) -> Optional[Layout]:
        """Heterogeneous mode, during a fit: the learners on each rank and each rank's per-replica batch size at the
        step in progress; None otherwise."""
        return self._layouts.layout_in_force() if self._layouts is not None else None

    @property
    def accumulating(self) -> bool:
        """Whether the replicas hold gradients of batches that an optimizer step is still to use
        (``accumulate_grad_batches > 1``, between two batches of one step); not once Lightning has reached a step's
        end, also where the module's ``optimizer_step`` skipped the step (Lightning zeroes those gradients)."""
        return self._gradients_pending and not self._at_a_steps_end()

    def _at_a_steps_end(self) -> bool:
        """Whether the batches Lightning has processed in this epoch end an optimizer step: a whole
        ``accumulate_grad_batches``, or the epoch's last batch."""
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        return done % trainer.accumulate_grad_batches == 0 or (
            progress.is_last_batch and done == progress.current.ready
        )

    @property
    def engine_measuring(self) -> bool:
        """Whether the last training step was one in which ``engine="auto"`` timed fused against streams (CUDA):
        such steps mix two engines, so the tuner does not count them."""
        return self._engine_trial_step

    @property
    def tuned_replicas_per_device(self) -> int:
        """The k a :class:`ReplicaAutoTuner` sets: ``replicas_per_device``; in heterogeneous mode the mean over
        ranks, ``K / world_size`` (each rank's own k, ``replicas_per_device``, follows its speed)."""
        if self.routing is not None:
            return sum(self.routing.latest) // self.world_size
        return self.replicas_per_device

    @property
    def samples_per_step(self) -> Optional[float]:
        """Samples one step trains on per process, ``k x`` the per-replica batch size (None if unknown); in
        heterogeneous mode the mean over processes."""
        if not self._batch_size:
            return None
        if self._layouts is not None:
            return sum(self._layouts.layout_in_force().learner_batch_sizes()) / self.world_size
        return self.replicas_per_device * self._batch_size

    @property
    def alpha(self) -> Optional[float]:
        """``sma``/``easgd``'s correction strength in use (the given alpha, or ``1/K``); None for other rules."""
        return self.averaging.alpha_for(self.num_learners) if isinstance(self.averaging, SMA) else None

    # ---------------------------------------------------------------------------- environment
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer
        if self.auto_replicas and not any(isinstance(c, ReplicaAutoTuner) for c in trainer.callbacks):
            # before the checkpoint callbacks (where Lightning puts a tuner given to the Trainer): a checkpoint saved
            # at a step's end holds the k that the tuner chose at it
            checkpoints = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, Checkpoint)]
            trainer.callbacks.insert(checkpoints[0] if checkpoints else len(trainer.callbacks), ReplicaAutoTuner())
        if self.period.period > 1 and not any(isinstance(c, AveragePendingSteps) for c in trainer.callbacks):
            trainer.callbacks.insert(0, AveragePendingSteps())  # (first: before any callback reads z)
        if not any(isinstance(c, ShowEpochCounts) for c in trainer.callbacks):
            trainer.callbacks.insert(0, ShowEpochCounts())  # (first: before a progress bar reads the count)
        if self.world_size == 1:
            # One process: keep the user's DataLoader and sampler exactly as they are (Lightning would otherwise
            # inject a shuffling DistributedSampler because this is a DDPStrategy).
            trainer._accelerator_connector.use_distributed_sampler = False
        if type(self.accelerator) in (CPUAccelerator, CUDAAccelerator):
            self.accelerator = CrossbowAccelerator(self.root_device.type)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.num_processes * self.num_nodes == 1 and not self.cluster_environment.creates_processes_externally:
            self._launcher = None  # one process: nothing to launch, no MASTER_*/LOCAL_RANK written to os.environ
            return
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        if self.world_size > 1:
            super().setup_distributed()
            # Lightning registers this only for NCCL. With gloo, a process group still alive when the
            # interpreter finalizes can abort the exit (SIGABRT, "terminate called without an active
            # exception") after a successful fit; destroying it while Python is alive avoids that.
            atexit.unregister(destroy_process_group_at_exit)  # once, however many fits this process runs
            atexit.register(destroy_process_group_at_exit)
            return
        # One process needs no process group (and no port): collectives are identities. Nor does it re-seed, as
        # DDP does for its processes: plain Lightning on one device does not, so k=1 draws the same random numbers.
        self.set_world_ranks()

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # never DistributedDataParallel: no gradient all-reduce

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise RuntimeError(
                "crossbow supports automatic optimization only (self.automatic_optimization = True): with"
                " manual optimization the training_step steps the optimizer itself, so crossbow cannot run it"
                " once per replica nor apply the model averaging after every replica's step."
            )
        if fitting and is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
            raise RuntimeError(
                "crossbow does not support training_step(self, dataloader_iter): crossbow hands every step a group"
                " of k batches that its own loader draws, one per replica, so the step cannot draw its batches"
                " itself. Take the batch as training_step(self, batch, batch_idx)."
            )
        if fitting and self._layer_sync is not None:  # (evaluation uses running statistics: nothing to sync)
            raise ValueError(
                "crossbow does not support Trainer(sync_batchnorm=True): each replica keeps its own BatchNorm"
                " statistics and z gets their mean over every replica of every process, so there is nothing to"
                " synchronise during the forward. Leave sync_batchnorm=False."
            )
        synced = [name for name, layer in module.named_modules() if isinstance(layer, torch.nn.SyncBatchNorm)]
        if fitting and synced:
            named = ", ".join(synced[:3]) + (", ..." if len(synced) > 3 else "")
            raise ValueError(
                f"crossbow does not train SyncBatchNorm layers ({named}):"
                " each replica keeps its own BatchNorm statistics and z gets their mean over every replica of every"
                " process, so there is nothing to synchronise during the forward. Build the model with BatchNorm"
                " layers (without nn.SyncBatchNorm.convert_sync_batchnorm)."
            )
        self._fit_loader = None  # (configure_optimizers may make it, in the set-up)
        if fitting and self.balancer is not None:
            # Before Lightning's set-up: configure_optimizers may read trainer.estimated_stepping_batches, which makes
            # the training loader there, and Lightning keeps that loader (it must be the routed one).
            self._start_routing(trainer)
        try:
            # The base Strategy's set-up: DDPStrategy's would wrap the module in DistributedDataParallel.
            Strategy.setup(self, trainer)
        except (MisconfigurationException, RuntimeError) as error:
            if "multiple optimizers" in str(error):  # Lightning's own advice (manual optimization) does not apply
                raise RuntimeError(_ONE_OPTIMIZER.format(count="more than one")) from error
            raise
        if self.world_size > 1:
            _sync_module_states(self.model)  # every rank starts from rank 0's weights
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.device != self.root_device.type:
            self.precision_plugin.device = self.root_device.type  # autocast on the device we run on
        if fitting:
            self._setup_replicas(trainer)
            if self.world_size > 1:
                self._sigterm_vote.install(trainer)

    def _setup_replicas(self, trainer: "pl.Trainer") -> None:
        if len(self.optimizers) != 1:
            raise RuntimeError(_ONE_OPTIMIZER.format(count=len(self.optimizers)))
        optimizer = self.optimizers[0]
        if isinstance(optimizer, _MockOptimizer):
            raise RuntimeError(_ONE_OPTIMIZER.format(count="none (configure_optimizers returned None)"))
        check_elementwise(optimizer, self.elementwise_optimizers)
        check_callbacks(trainer)
        warn_of_step_schedules_under_tuning(trainer)
        adapt_throughput_monitors(trainer)
        adapt_finetuning_callbacks(trainer, self.optimizer_over_module_parameters)
        self._check_same_config_on_all_ranks()
        module = self.lightning_module
        if self.engine_name == "streams" and self._stream_pool() is None:
            raise ValueError(STREAMS_NEED_CUDA.format(device=self.root_device))
        self.stack = ReplicaStack(module, self.replicas_per_device)
        self._point_at_the_replicas(optimizer)
        self.stack.note_center_params()  # (noted again after a checkpoint's restore)
        self._without_replicas = [(name, param) for name, param in module.named_parameters() if not param.requires_grad]
        self._fastest_engine.clear()  # (a new fit may train another model: its engines are measured afresh)
        self.engine = self._make_engine(self.replicas_per_device)
        self._reads_gradients = hooks_read_gradients(module, trainer.callbacks)
        self._expose_mean_gradients()
        if self._reads_gradients:
            self._refresh_mean_gradients_before_hooks()
            self._show_gradients_zeroed_with_the_replicas(optimizer)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm_per_replica  # type: ignore[method-assign]
        hooks_owners = [module, trainer.datamodule] if trainer.datamodule is not None else [module]
        self._transfer_per_batch = any(is_overridden(hook, owner) for hook in TRANSFER_HOOKS for owner in hooks_owners)
        self._before_transfer_per_batch = any(is_overridden("on_before_batch_transfer", o) for o in hooks_owners)
        if self._before_transfer_per_batch:
            # Lightning's loop hands the whole group to on_before_batch_transfer: one batch at a time instead, each
            # right before its own transfer where the transfer hooks are the user's too (see batch_to_device).
            hook = group_as_it_is if self._transfer_per_batch else on_before_batch_transfer_per_batch
            module._on_before_batch_transfer = MethodType(hook, module)  # type: ignore[method-assign]
        self._last_lrs = self._lrs_before_last = None
        self._final_state, self._center_after_fit = None, {}
        self.period.restart()
        self._averaging_now, self._average_at_step_end, self._lr_drop_pending = True, False, False

    def _start_routing(self, trainer: "pl.Trainer") -> None:
        """Heterogeneous mode: every rank starts a fit at k learners (an even split), the data routed by the split."""
        assert self.balancer is not None
        if trainer.accumulate_grad_batches > 1:
            raise ValueError(
                "crossbow: heterogeneous=True cannot be combined with accumulate_grad_batches > 1: a new split of the"
                " learners may start between two accumulated batches, and the gradients accumulated for the"
                " replicas a rank gives up would be lost."
            )
        self._layouts = LearnerLayouts(self.balancer, self.replicas_per_device, self.world_size, self.global_rank)

    def _check_same_config_on_all_ranks(self) -> None:
        config = {
            "replicas_per_device": self.replicas_per_device,
            "algorithm": self.algorithm,
            "alpha": self._alpha,
            "central_momentum": self.central_momentum,
            "outer_lr": self.outer_lr,
            "warmup_epochs": self.warmup_epochs,
            "engine": self.engine_name,
            "reset_on_lr_drop": self.reset_on_lr_drop,
            "averaging_period": self.period.period,
            # (the tuner's windows end with a collective: "auto" on one rank only waited for the others for good)
            "tuned by ReplicaAutoTuner": any(
                isinstance(c, ReplicaAutoTuner) for c in self.lightning_module.trainer.callbacks
            ),
            "heterogeneous": None
            if self.balancer is None
            else (
                self.balancer.every,
                self.balancer.min_gain,
                self.balancer.remember,
                self.balancer.max_batch_scale,
                self.balancer.lr_follows_batch,
            ),
        }
        configs = self._gather_objects(config)
        differing = [key for key in config if any(c[key] != config[key] for c in configs)]
        if differing:
            per_rank = "; ".join(
                f"rank {r}: " + ", ".join(f"{k}={c[k]!r}" for k in differing) for r, c in enumerate(configs)
            )
            raise RuntimeError(
                f"crossbow: the processes disagree on {', '.join(differing)} ({per_rank}). Every process must"
                " construct CrossbowStrategy with the same arguments."
            )

    def _unfuse_for_replicas(self, optimizer: Optimizer) -> None:
        """With more than one replica, the optimizer's ``fused=True`` kernels are turned off for good
        (:func:`~lightning_crossbow.optim.unfuse_`: they step the stacked parameters wrongly), with a warning. The
        checkpoint's optimizer state over the module's parameters still asks for them (:meth:`optimizer_state`)."""
        assert self.stack is not None
        unfused = unfuse_(optimizer) if self.stack.num_replicas > 1 else []
        self._unfused_groups.update(unfused)
        if unfused:
            rank_zero_warn(
                f"crossbow: {type(optimizer).__name__}(fused=True) steps non-contiguous parameters wrongly (a PyTorch"
                " limitation), and with more than one replica the stacked parameters are views of one flat buffer;"
                " crossbow runs it with fused=False (its foreach implementation: the same update)."
            )

    def _clip_grad_by_norm_per_replica(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_per_replica_(stacked_params(optimizer), self._stacked_leaves(), float(clip_val))

    # ------------------------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._batch_size = getattr(dataloader, "batch_size", None)
        grouped: ReplicaBatchLoader
        if self.routing is not None:
            grouped = routed = self._routed_loader(dataloader)
            batches_per_step, per_step = sum(self.routing.latest), f"K={sum(self.routing.latest)} learners"
            length: Optional[int] = routed.routed_sampler.batches_per_epoch()  # the common order's, shared out
            most = length // self.world_size  # (per device: K = replicas_per_device x world_size)
        else:
            # k of the loader's first group: a resume's, or a change of k under way (a loader reloaded between
            # epochs, after a change made at the last step), else the replicas'
            k = self._resumed_group_size or self._k_next_group or self.replicas_per_device
            self._resumed_group_size = None
            if self._grouped is not None:  # (a loader reloaded: plain Lightning drew every batch of the last pass)
                self._grouped.draw_tail()
            grouped = ReplicaBatchLoader(dataloader, k)
            counts, self._resumed_pass_counts = self._resumed_pass_counts, None
            trained, self._resumed_pass_trained = self._resumed_pass_trained, None
            grouped.counts_on_resume = counts
            self._epoch.fraction_as_steps(trainer, grouped)
            if trained is not None and not saves_its_position(dataloader):  # (one that does: Lightning loads it)
                self._count_on_from_the_checkpoint(grouped, trained, pass_begun=False, step_ended=trained == counts)
            batches_per_step, per_step = k, f"replicas_per_device={k}"
            length = most = loader_length(dataloader)
        self._grouped = self._epoch.loader = self._fit_loader = grouped
        if length is not None and 0 < length < batches_per_step:  # (none at all: nothing to train, as in Lightning)
            raise ValueError(
                f"crossbow: the training DataLoader has {length} batches per epoch, fewer than the"
                f" {batches_per_step} that one step takes ({per_step}): not one step could be made. Use at most"
                f" replicas_per_device={most}, or give the loader more batches (a smaller batch size)."
            )
        dropped = grouped.dropped_batches()
        if isinstance(grouped, RoutedBatchLoader) and dropped:
            sampler = grouped.routed_sampler
            rank_zero_warn(
                f"crossbow: the training DataLoader has {sampler.samples_per_epoch()} samples; the last"
                f" {sampler.skipped_samples()} of every epoch's common order do not fill a step of {per_step}"
                f" ({sum(self.routing.latest_layout.learner_batch_sizes())} samples) and are skipped."
            )
        elif dropped:
            batches = f"has {len(grouped) * batches_per_step + dropped} batches"
            if grouped.batch_limit is not None:  # (a fraction of them)
                limit = f"{limit_argument(trainer)}={self._epoch.train_fraction}"
                batches = f"gives {grouped.batch_limit} batches an epoch ({limit})"
            rank_zero_warn(
                f"crossbow: the training DataLoader {batches}, not a multiple of {per_step}; the last {dropped}"
                " batch(es) of every epoch do not fill a step and are skipped."
            )
        return grouped

    def _count_on_from_the_checkpoint(
        self, grouped: ReplicaBatchLoader, counts: tuple[int, int], pass_begun: bool, step_ended: bool
    ) -> None:
        """A resumed epoch whose loader's position is not restored counts on from the checkpoint's ``counts`` (see
        :meth:`~lightning_crossbow.data.ReplicaBatchLoader.count_on_from`): one saved in the middle of an epoch, not
        after its last step (``step_ended``: the last step counted had ended) nor at its end (a fit stopped within
        it by ``max_steps`` saves at its end)."""
        if self._resumes_in_an_epochs_middle(step_ended):
            grouped.count_on_from(counts, pass_begun)

    def _resumes_in_an_epochs_middle(self, step_ended: bool) -> bool:
        """Whether the checkpoint restored was saved in the middle of an epoch: not after its last step (``step_ended``:
        the last step counted had ended) nor at its end (a fit stopped within it by ``max_steps`` saves at its end)."""
        fit_loop = self.lightning_module.trainer.fit_loop
        epoch = fit_loop.epoch_progress.current
        last_step_done = step_ended and fit_loop.epoch_loop.batch_progress.is_last_batch
        return epoch.processed < epoch.started and not last_step_done

    def _routed_loader(self, dataloader: object) -> RoutedBatchLoader:
        """The user's loader drawing this rank's share of a common order (see :mod:`~lightning_crossbow.routing`)."""
        assert self._layouts is not None
        problem = why_unroutable(dataloader)
        sampler = getattr(dataloader, "sampler", None)
        # On several processes Lightning has put its DistributedSampler in (it still splits the evaluation loaders):
        # its shuffle and seed are the user's, and the order is drawn anew below over the whole dataset.
        injected = type(sampler) is DistributedSampler
        seed = sampler.seed if injected else int(os.getenv("PL_GLOBAL_SEED", 0))  # (the seed Lightning's takes)
        shuffle = sampler.shuffle if injected else isinstance(sampler, RandomSampler)
        length = len(dataloader.dataset) if problem is None else None  # type: ignore[attr-defined]
        batches = (getattr(dataloader, "batch_size", None), getattr(dataloader, "drop_last", None), shuffle)
        # every rank learns of any rank's problem: none is left waiting in a collective
        ranks = self._gather_objects((problem, length, seed, batches))
        problems = [p for p, *_ in ranks if p is not None]
        if problems:
            raise ValueError(
                "crossbow: heterogeneous=True routes batches of one common order of the whole dataset to the ranks,"
                f" so the training DataLoader needs {problems[0]}."
            )
        if len({(n, r) for _, n, r, _ in ranks}) > 1:
            raise ValueError(
                "crossbow: heterogeneous=True needs the whole dataset and the same seed on every rank (it draws one"
                f" common order and routes it itself); the ranks have (dataset length, PL_GLOBAL_SEED) = "
                f"{[(n, r) for _, n, r, _ in ranks]}."
            )
        if len({b for *_, b in ranks}) > 1:
            raise ValueError(
                "crossbow: heterogeneous=True cuts one common order into the same groups on every rank, so every"
                " rank's training DataLoader needs the same batch_size, drop_last and shuffle (the balancer gives"
                " faster ranks larger batches itself: SpeedBalancer(max_batch_scale=...)); the ranks have (batch_size,"
                f" drop_last, shuffle) = {[b for *_, b in ranks]}."
            )
        assert isinstance(dataloader, DataLoader) and dataloader.batch_size is not None
        order = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        routed = RoutedBatchSampler(order, dataloader.batch_size, dataloader.drop_last, self._layouts.plan)
        self._layouts.check_restored_batch_sizes()
        # the user's loader (its workers, collate_fn, pin_memory...) made again over the routed batches
        args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, order, mode=RunningStage.TRAINING)
        names = getattr(dataloader, "__pl_saved_arg_names", ())  # (arguments given by position, as DataLoader(d, 64))
        parameters = inspect.signature(type(dataloader).__init__).parameters.values()
        if len(names) == len(args) and all(p.kind is not p.VAR_POSITIONAL for p in parameters):
            args, kwargs = (), {**dict(zip(names, args)), **kwargs}
        kwargs.update(sampler=None, shuffle=False, batch_sampler=routed, batch_size=1, drop_last=False)
        loader = RoutedBatchLoader(_reinstantiate_wrapped_cls(dataloader, *args, **kwargs), routed)
        if self._resumed_routed_place is not None:
            loader.resume_pass_at(*self._resumed_routed_place)
            self._resumed_routed_place = None
        return loader

    # ------------------------------------------------------------------------------- training
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()
        self._training_step_logged = False
        trainer = self.lightning_module.trainer
        assert self.stack is not None
        self._epoch.start_batch(trainer, batch_idx, isinstance(batch, list), self.stack.num_replicas)
        if self._layouts is not None and isinstance(self._grouped, RoutedBatchLoader):
            if self._routed_place_unknown:
                self._routed_place_unknown = False
                rank_zero_warn(
                    "crossbow: the checkpoint holds no place in heterogeneous mode's common order of the data (it was"
                    " saved by the uniform path, or an earlier version): the resumed epoch draws its data from the"
                    " order's start."
                )
            layout = self._layouts.plan.layout_at(self._grouped.current_group)
            if layout != self._layouts.layout_in_force():  # (every rank changes at this same step)
                self.average_pending_steps()  # no learner leaves with steps that z has not taken in
                self._layouts.balancer.restart()  # a window measures one layout
            self._layouts.put_in_force(layout)
        if self._gradients_pending and not self.accumulating:
            # An optimizer step begins where Lightning zeroes the gradients, also after batches that no optimizer
            # step followed (an ``optimizer_step`` that runs the closure alone, skipping the step): their losses
            # and skips are dropped with their gradients.
            self._step_losses = self._step_skipped = None
            self._gradients_pending = False
        if isinstance(batch, list) and batch and len(batch) != self.stack.num_replicas:
            # The first group made after set_replicas_per_device: resize before the step's corrections.
            if self._gradients_pending:  # (a group fetched ahead, within an accumulation window)
                self._average_at_step_end = self.period.steps_since > 0  # the learners cannot restart from z now
            else:
                self.average_pending_steps()
            self._resize_replicas(len(batch))
        self.stack.take_center_buffer_changes_()  # (what a hook set since the last step)
        self._follow_trainable_parameters(step_starts=not self._gradients_pending)
        if not self._gradients_pending:  # an optimizer step's first batch (the lr changes only between steps)
            self._reset_if_lr_dropped()
            if trainer.fit_loop._skip_backward:
                self._start_forward_only_step()
        elif self._mean_gradients is not None:  # what a hook changed since the last batch accumulates on
            self._mean_gradients.apply_changes_()

    def _start_forward_only_step(self) -> None:
        """While Lightning skips the backward (``StochasticWeightAveraging``'s BatchNorm epoch, whose forwards only
        recompute the running statistics of the weights it averaged), nothing trains: every replica runs its
        forwards from z, weights and buffers as the module holds them (the callback reset its statistics), and z's
        momentum forgets the callback's change of z (z_prev <- z). The step that ends the window gives z the
        replicas' mean buffers; without gradients it moves no weight (:meth:`_nothing_to_step`)."""
        assert self.stack is not None
        self.stack.reset_replicas_(self.lightning_module, buffers=True)
        for bucket in self.stack.buckets:
            bucket.center_prev.copy_(bucket.center)

    def _forward_only_engine(self) -> Engine:
        """The engine of the steps whose backward Lightning skips: the replicas one after another (sequential).
        Nothing is trained, and ``vmap`` cannot run BatchNorm's cumulative average (``momentum=None``, which
        ``StochasticWeightAveraging`` sets for them): it reads the count of batches seen as a number."""
        if self._sequential_forwards is None:
            self._sequential_forwards = SequentialEngine(self.lightning_module)
        return self._sequential_forwards

    def _nothing_to_step(self) -> bool:
        """Whether no replica's parameter has a gradient: the user's optimizer would move nothing (it passes over a
        parameter without one), so no rule moves z either, as when every replica skips the step."""
        assert self.stack is not None
        return all(leaf.grad is None for leaf in self.stack.params.values())

    def _follow_trainable_parameters(self, step_starts: bool) -> None:
        """Follows what a callback or hook changed since the last batch: a parameter frozen is no longer trained
        and, from the next optimizer step on, stays as it is
        (:meth:`~lightning_crossbow.replicas.ReplicaStack.follow_requires_grad_`); one unfrozen again is trained; a
        parameter frozen when training started gets its replicas once unfrozen (:meth:`_give_replicas_to`); a
        param group added to the optimizer steps the replicas."""
        assert self.stack is not None
        unfrozen = [name for name, param in self._without_replicas if param.requires_grad]
        if unfrozen:
            self._give_replicas_to([unfrozen])
            rank_zero_info(
                f"crossbow: {', '.join(unfrozen)} unfrozen: {self.stack.num_replicas} replica(s) of each made from z."
            )
        self.stack.follow_requires_grad_(hold=step_starts, at_mean=self.averaging.center_is_learner_mean)
        if len(self.optimizers) != 1 or self.optimizers[0] is not self._optimizer_seen:
            self._take_in_a_new_optimizer()
        optimizer = self.optimizers[0]
        if len(optimizer.param_groups) != self._param_groups_seen:  # (add_param_group: the module's parameters)
            self._repoint_optimizer()
            params = stacked_params(optimizer)
            if len({id(param) for param in params}) != len(params):
                raise ValueError(
                    "crossbow: a param group added to the optimizer during training holds parameters that another"
                    " group already holds; every parameter may be in one group only."
                )
            self._unfuse_for_replicas(optimizer)  # (the new group may ask for fused kernels)
            self._param_groups_seen = len(optimizer.param_groups)

    def _take_in_a_new_optimizer(self) -> None:
        """An optimizer made during fit (a callback's ``trainer.strategy.setup_optimizers(trainer)``, or
        ``trainer.optimizers = [...]``: Adam first, then SGD, say) steps the replicas as the first one did, its state
        starting afresh, as the new optimizer's does in plain Lightning (before, it stepped the module's parameters,
        which no backward reaches, and training stopped)."""
        if len(self.optimizers) != 1:
            raise RuntimeError(_ONE_OPTIMIZER.format(count=len(self.optimizers)))
        old, optimizer = self._optimizer_seen, self.optimizers[0]
        check_elementwise(optimizer, self.elementwise_optimizers)
        if old is not None:
            vars(old).pop("zero_grad", None)  # (crossbow's, see _show_gradients_zeroed_with_the_replicas)
        self._last_lrs = self._lrs_before_last = None  # (another optimizer's learning rates: no drop to compare)
        self._point_at_the_replicas(optimizer)
        if self._reads_gradients:
            self._show_gradients_zeroed_with_the_replicas(optimizer)

    def _point_at_the_replicas(self, optimizer: Optimizer) -> None:
        """``optimizer`` (the one of ``self.optimizers``) steps the stacked replicas: its params re-pointed, its fused
        kernels turned off where they would step them wrongly; it is the optimizer seen, with its param groups."""
        self._optimizer_seen = optimizer
        self._repoint_optimizer()
        self._unfused_groups = set()
        self._unfuse_for_replicas(optimizer)
        self._param_groups_seen = len(optimizer.param_groups)

    def _give_replicas_to(self, buckets: list[list[str]]) -> None:
        """Parameters that had no replicas (frozen when training started) get them, each replica a copy of z, the
        names of each list of ``buckets`` in flat buffers of their own
        (:meth:`~lightning_crossbow.replicas.ReplicaStack.add_replicas_`); then the optimizer, the engine and the
        mean gradients that hooks see take them in, once. Every process does this at the same point (a callback's
        unfreezing runs on each), so their flat buffers, which the averaging all-reduces, keep one layout."""
        assert self.stack is not None and self.engine is not None
        for names in buckets:
            self.stack.add_replicas_(self.lightning_module, names)
        given = {name for names in buckets for name in names}
        self._without_replicas = [(name, param) for name, param in self._without_replicas if name not in given]
        self._repoint_optimizer()
        self._expose_mean_gradients()  # (on the new leaves too)
        self._renew_engine(self.stack.num_replicas)  # (a fused engine found its layers for the old leaves)

    @contextmanager
    def optimizer_over_module_parameters(self) -> Iterator[None]:
        """For code that finds the optimizer's parameters by the module's own (Lightning's ``BaseFinetuning``):
        inside, the optimizer's param groups hold the module's parameters in place of their stacked replicas; on
        leaving, the replicas again, and what the code changed (a parameter unfrozen, a param group added) is
        followed at once. The optimizer's state, kept by the stacked leaves, is untouched."""
        if self.stack is None:  # (not training)
            yield
            return
        module = self.lightning_module
        by_leaf = {id(leaf): module.get_parameter(name) for name, leaf in self.stack.params.items()}
        for group in self.optimizers[0].param_groups:
            group["params"] = [by_leaf.get(id(param), param) for param in group["params"]]
        try:
            yield
        finally:
            self._repoint_optimizer()
        self._follow_trainable_parameters(step_starts=False)

    def _repoint_optimizer(self) -> None:
        """Puts the stacked leaves in the optimizer in place of the module's parameters that have replicas."""
        assert self.stack is not None
        module = self.lightning_module
        repoint_to_stack(
            self.optimizers[0],
            {id(module.get_parameter(name)): stacked for name, stacked in self.stack.params.items()},
            self.stack.num_replicas,
        )

    def _reset_if_lr_dropped(self) -> None:
        """With ``reset_on_lr_drop``: the replicas restart from z when the lr has dropped since the last optimizer
        step (:func:`lr_dropped`). Called once per optimizer step, before it. Between two averagings
        (``averaging_period > 1``), z has not taken in the replicas' steps since the last one: they restart from z
        right after the next (no collective here: a drop that one process alone sees must not leave others waiting).
        Gossip, whose learners meet at their mean on each process instead of at z, resets right at the drop."""
        optimizer = self.optimizers[0]
        lrs = [float(group["lr"]) for group in optimizer.param_groups]
        dropped = (
            self._last_lrs is not None
            and self.reset_on_lr_drop
            and not self.averaging.learners_start_at_center  # (they start from z after every averaging)
            and lr_dropped(lrs, self._last_lrs, self._lrs_before_last)
        )
        self._last_lrs, self._lrs_before_last = lrs, self._last_lrs
        if not (dropped or self._lr_drop_pending):
            return
        gossip = self.averaging.center_is_learner_mean
        self._lr_drop_pending = self.period.steps_since > 0 and not gossip
        if not self._lr_drop_pending:
            assert self.stack is not None
            if self.averaging.center_is_learner_mean:
                # Gossip keeps no z while training: the learners meet at their mean on this process. No collective,
                # so a drop that one process alone sees (a per-rank plateau metric) cannot leave the others waiting.
                self.stack.gather_replicas_at_their_mean_()
                rank_zero_info(
                    f"crossbow: learning rate dropped to {lrs}; each process's learners reset to their mean."
                )
            else:
                self.stack.reset_replicas_(self.lightning_module)
                rank_zero_info(f"crossbow: learning rate dropped to {lrs}; every replica reset to the central model.")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.stack is not None and self.engine is not None
        self._step_call = args  # (for a sequential run of the same batch: see backward)
        self._batch_starts_step = not self._gradients_pending
        batches, rest = args[0], args[1:]
        if batches is self._group and self._group_cut is not None:  # run again after an out-of-memory back-off
            batches = batches[: self._group_cut]
        else:
            self._group, self._group_cut = batches, None
        if not isinstance(batches, list) or len(batches) != self.stack.num_replicas:
            raise RuntimeError("crossbow expected a group of replicas_per_device batches from its training loader.")
        module = self.lightning_module
        if not self.stack.is_bound():
            self.stack.rebind_(module)
        if not self._gradients_pending:  # an optimizer step's first batch
            self.stack.rows_reached.clear()
            if self.averaging.learners_start_at_center and self.period.steps_since == 0:  # (after an averaging)
                self.stack.reset_replicas_(module)
                if self.period.period > 1:
                    self.stack.note_center_for_shifts()
            else:  # between two averagings: a hook's change to z moves them
                self._take_center_shift()
        forward_only = module.trainer.fit_loop._skip_backward  # (StochasticWeightAveraging's epoch for BatchNorm)
        engine = self.engine if not forward_only else self._forward_only_engine()
        with self.precision_plugin.train_step_context():
            self._replicas_in_module = self.num_learners > 1  # (K: every rank refuses alike)
            self._running_replica_steps = True
            try:
                output = engine.run(self.stack, batches, rest, self._log_capture)
            finally:
                self._replicas_in_module = self._running_replica_steps = False
        if forward_only:  # no backward follows, whose end replays the logs
            self._replay_logs()
        losses = output.losses
        self._step_losses = losses if self._step_losses is None else self._step_losses + losses
        # A replica skips the step only if it skipped every batch the step accumulates (None: none skipped).
        if not self._gradients_pending:
            self._step_skipped = output.skipped
        elif self._step_skipped is not None:
            self._step_skipped = None if output.skipped is None else self._step_skipped & output.skipped
        if self._mean_gradients is not None:  # hooks see the mean over the replicas that take the step
            taking = self._step_losses.isfinite() & (True if self._step_skipped is None else ~self._step_skipped)
            self._mean_gradients.rows = None if bool(taking.all()) else taking
        self._gradients_pending = True
        if output.total is None:  # every replica skipped
            if self.world_size == 1:
                self._replay_logs()
                self._group = self._group_cut = None
                return None  # Lightning skips the backward, as for a plain module
            # Lightning refuses a skipped step across processes, and the other ranks' averaging waits for this
            # one: a zero loss, attached to the replicas, gives them zero gradients (the rows are held and dropped).
            return sum(leaf.sum() for leaf in self.stack.params.values()) * 0.0
        loss = reported_as_mean(output.total, losses, output.skipped)
        return {"loss": loss, **output.extras} if output.returned_dict else loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward. A batch that ran fused under ``engine="auto"`` and whose backward then fails inside
        autograd (``vmap``'s rules for the backward: non-reentrant activation checkpointing, say) runs again
        sequentially, as one that fails in the forward does
        (:meth:`~lightning_crossbow.engines.Engine.fall_back_after_backward`): at an optimizer step's first batch
        (no gradients accumulated, which the failed backward may have added to), its losses and logs dropped and
        its gradients cleared, its ``training_step`` run again and its backward (``on_before_backward`` runs once
        more). An error raised outside autograd (a hook's), or that the sequential run raises as well, is raised,
        without the fallback's warning."""
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the engine says whether it may run the batch again
            if not self._may_run_again_sequentially(error):
                raise
            # (without its traceback, which would hold the failed attempt's frames and activations during the rerun)
            failure = error.with_traceback(None)
            failure.__context__ = failure.__cause__ = None
        assert self.stack is not None and self.engine is not None
        self._step_losses = self._step_skipped = None
        self._gradients_pending = False
        self.stack.release_gradients_()
        try:
            output = self.training_step(*self._step_call)
            # (its loss as Lightning's closure makes it: divided by accumulate_grad_batches)
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            loss = ClosureResult.from_training_step_output(output, accumulate).closure_loss
            result = closure_loss if loss is None else super().backward(loss, optimizer, *args, **kwargs)
        except Exception as again:
            self.engine.after_rerun(failure, again)
            raise
        self.engine.after_rerun(failure, None)
        return result

    def _may_run_again_sequentially(self, error: BaseException) -> bool:
        """Whether the batch whose backward raised ``error`` may run again sequentially (see :meth:`backward`); if
        so, the engine has undone its fused forward."""
        assert self.stack is not None and self.engine is not None
        return (
            self._batch_starts_step
            and not isinstance(error, torch.cuda.OutOfMemoryError)  # (not vmap's doing)
            and not self.lightning_module.trainer.fit_loop._skip_backward  # (forwards only, run sequentially)
            and raised_inside_autograd(error)
            and self.engine.fall_back_after_backward(self.stack, self._log_capture)
        )

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self._mean_gradients is not None:  # what on_after_backward changed in the module's gradients
            self._mean_gradients.apply_changes_()
        self._replay_logs()
        self._group = self._group_cut = None  # the step's forward and backward ran: no retry can follow

    def _replay_logs(self) -> None:
        """Logs what the replicas logged (their mean), once the step's backward has run: a step that runs out of
        memory in its backward and runs again with fewer replicas logs once. Hooks that run inside the backward
        read the previous step's values in ``trainer.callback_metrics``."""
        with self._logging_as_training_step() as module:
            self._log_capture.replay(module, lambda: extract_batch_size(self._group))
            self._training_step_logged = module.trainer._logger_connector._current_fx == "training_step"

    @contextmanager
    def _logging_as_training_step(self, step_metrics: bool = False) -> Iterator["pl.LightningModule"]:
        """The module, its ``self.log`` calls taken as ``training_step``'s (Lightning keys a logged value by the
        hook that logs it, and checks where it may be logged). Lightning resets a hook's values logged in the last
        epoch at its first ``self.log`` of an epoch's first batch that follows another hook's (in plain Lightning,
        where ``training_step`` logs once a batch, its first): where the replicas' logs were replayed in this batch
        already, a hook's logs since (``on_before_optimizer_step``'s) do not make crossbow's metrics reset them; and
        crossbow's metrics (``step_metrics``), logged where plain Lightning logs nothing, leave Lightning's record of
        the last hook that logged as it was, so that they make no later hook's values reset either."""
        module = self.lightning_module
        connector = module.trainer._logger_connector
        hook, module._current_fx_name = module._current_fx_name, "training_step"
        last_logged = connector._current_fx
        if self._training_step_logged:
            connector._current_fx = "training_step"
        try:
            yield module
        finally:
            module._current_fx_name = hook
            if step_metrics:
                connector._current_fx = last_logged

    # ------------------------------------------------------------------------- changing k
    def set_replicas_per_device(self, replicas_per_device: int) -> None:
        """Changes k during training, without restarting fit.

        The training loader makes its next groups with the new k (a group Lightning has already
        prefetched keeps the old one: only loaders without a length are prefetched), and the replicas
        follow when the first such group arrives:
        kept replicas go on, new ones start as copies of z with the mean of the replicas' optimizer
        state, ``alpha=None`` follows 1/K, and the epoch's length follows the new grouping. Every
        process must make the same call at the same step (:class:`ReplicaAutoTuner` does).
        """
        check_int("replicas_per_device", replicas_per_device)
        if self.routing is not None:
            if replicas_per_device == self.tuned_replicas_per_device:
                return
        elif replicas_per_device == (
            self._grouped.num_replicas if self._grouped is not None else self.replicas_per_device
        ):
            return
        trainer = self._lightning_module._trainer if self._lightning_module is not None else None
        if self.stack is not None and self.accumulating:
            raise RuntimeError(
                "crossbow cannot change replicas_per_device while gradients are being accumulated"
                f" (accumulate_grad_batches={trainer.accumulate_grad_batches if trainer else '?'}): the gradients"
                " accumulated for the current replicas would not fit the new ones. Change it right after an"
                " optimizer step (ReplicaAutoTuner waits for one)."
            )
        if self.stack is None:  # not training: the next fit starts with it
            self.replicas_per_device = replicas_per_device
            return
        assert self._grouped is not None and trainer is not None
        self._refuse_a_step_longer_than_an_epoch(replicas_per_device)
        if self._layouts is not None:
            # K = k x world_size learners, split by the speeds measured last, from a group no rank has drawn.
            drawn = torch.tensor([float(self._layouts.plan.groups_drawn)])
            first_free_group = int(self._all_gather_rows(drawn)[:, 0].max())
            self._layouts.schedule_k(
                replicas_per_device * self.world_size, self.world_size, first_free_group, trainer.global_step
            )
        else:
            self._grouped.num_replicas = self._k_next_group = replicas_per_device
        self._epoch.k_changed(trainer, self.stack.num_replicas)

    def _refuse_a_step_longer_than_an_epoch(self, replicas_per_device: int) -> None:
        """During fit, a new k whose one step takes more batches than an epoch has would train nothing from then on:
        refused, as at set-up (the same on every rank: every rank's epoch has as many batches). Before this fit's
        loader is made (in ``on_fit_start``), the loader's own set-up checks it."""
        loader = self._fit_loader
        if loader is None:
            return
        if isinstance(loader, RoutedBatchLoader):  # (K learners, at the DataLoader's batch size)
            have, need = loader.routed_sampler.batches_per_epoch(), replicas_per_device * self.world_size
            over = f" over {self.world_size} processes" if self.world_size > 1 else ""
            what = f"the {need} that one step{over} would take"
        else:
            have, need = loader.pass_batches(), replicas_per_device
            what = f"the {need} that one step would take"
        if have is not None and 0 < have < need:
            most = max(1, have // (need // replicas_per_device))
            raise ValueError(
                f"crossbow: set_replicas_per_device({replicas_per_device}) during fit: an epoch has {have} training"
                f" batches, fewer than {what}, so no step could be made from then on. Use at most"
                f" replicas_per_device={most}."
            )
        keeping = self.replicas_keeping_validation()
        if keeping is not None and replicas_per_device > keeping:
            trainer = self.lightning_module.trainer
            raise ValueError(
                f"crossbow: set_replicas_per_device({replicas_per_device}) during fit: an epoch would have fewer steps"
                f" than val_check_interval={trainer.val_check_interval} (steps of k batches), so it would never"
                f" validate again (Lightning refuses that at set-up). Use at most replicas_per_device={keeping}."
            )

    def replicas_fitting_an_epoch(self) -> Optional[int]:
        """The largest k such that no k' <= k leaves more than a tenth of an epoch's batches out of its last,
        unfilled step (``batches mod k' <= batches / 10``), and at most :meth:`replicas_keeping_validation`; at
        least 1. None when the training loader has no length or the data are routed (heterogeneous mode)."""
        trainer = self.lightning_module.trainer
        fitting, keeping = self._epoch.replicas_fitting_an_epoch(trainer), self.replicas_keeping_validation()
        return fitting if fitting is None or keeping is None else min(fitting, keeping)

    def replicas_keeping_validation(self) -> Optional[int]:
        """The largest k whose epochs hold an integer ``val_check_interval``'s steps (with ``check_val_every_n_epoch``
        set: each epoch counts its own), so that it still validates; None where no such bound holds."""
        return self._epoch.replicas_keeping_validation(self.lightning_module.trainer)

    def _back_off(self, error: BaseException) -> None:
        """After an out-of-memory error in the step's forward or backward: one replica fewer from now on.

        The group's first k-1 batches run again (``training_step`` cuts the group Lightning passes again);
        its last batch goes back to the loader and opens the next group, so no batch is lost.
        ``replica_ceiling`` keeps the tuner below k.
        """
        assert self.stack is not None and self._grouped is not None and self._group is not None
        k = self.stack.num_replicas - 1
        if k == 0:
            raise error
        self._log_capture.clear()
        self._grouped.give_back(self._group[k : len(self._group) if self._group_cut is None else self._group_cut])
        self._group_cut = k
        self.set_replicas_per_device(k)
        self.average_pending_steps()  # (the steps before this one: the learner that goes leaves none behind)
        self._averaging_now = self.period.due(self._ends_an_epoch)
        self._resize_replicas(k)
        self.replica_ceiling = k
        rank_zero_warn(
            f"crossbow: out of memory with replicas_per_device={k + 1} ({error.__class__.__name__}); the step runs"
            f" again with {k} replicas and the last batch opens the next step. k stays at most {k} from now on."
        )

    def _resize_replicas(self, replicas_per_device: int) -> None:
        assert self.stack is not None and self.engine is not None
        if self.averaging.center_is_learner_mean:
            self.sync_center()  # new learners start from z, the learners' mean (every rank resizes together)
        old_leaves = dict(self.stack.params)
        self.stack.resize_(replicas_per_device)
        self.period.resize(replicas_per_device)
        resize_stacked_state_(
            self.optimizers[0],
            {id(old_leaves[name]): new for name, new in self.stack.params.items()},
            replicas_per_device,
        )
        self._unfuse_for_replicas(self.optimizers[0])
        if self._gradients_pending:
            # A group Lightning fetched ahead (a loader without a length) kept the old k and opened an
            # accumulation window: kept replicas keep what they accumulated, new ones start from nothing.
            with torch.no_grad():
                for name, leaf in self.stack.params.items():
                    grad = old_leaves[name].grad
                    if grad is not None:
                        leaf.grad = resize_rows(grad, replicas_per_device, fill=torch.zeros_like(grad[0]))
            if self._step_losses is not None:
                self._step_losses = resize_rows(
                    self._step_losses, replicas_per_device, fill=self._step_losses.new_zeros(())
                )
            if self._step_skipped is not None:
                self._step_skipped = resize_rows(
                    self._step_skipped, replicas_per_device, fill=self._step_skipped.new_zeros(())
                )
        else:
            self._step_losses = self._step_skipped = None
        self._expose_mean_gradients()  # on the new stacked leaves
        self._renew_engine(replicas_per_device)
        self.replicas_per_device, self._k_next_group = replicas_per_device, None
        if self.routing is None:  # (heterogeneous mode reports each new split as a whole)
            rank_zero_info(f"crossbow: replicas_per_device is now {replicas_per_device} (K = {self.num_learners}).")

    def _log_crossbow_metrics(self) -> None:
        """Logs k, samples/s (both on the progress bar), the learning rate and the outer one or the replicas'
        spread, at logging steps, once the optimizer step's averaging has run: each is that step's own."""
        assert self.stack is not None
        if not self.lightning_module.trainer._logger_connector.should_update_logs:  # (log_every_n_steps)
            return
        once = {"on_step": True, "on_epoch": False, "batch_size": 1}
        with self._logging_as_training_step(step_metrics=True) as module:
            # (in heterogeneous mode the mean over ranks, which every rank logs alike; samples/s is this rank's)
            metrics = {"crossbow/replicas_per_device": float(self.tuned_replicas_per_device)}
            if self.samples_per_second is not None:
                metrics["crossbow/samples_per_sec"] = self.samples_per_second
            module.log_dict(metrics, prog_bar=True, **once)
            if isinstance(self.averaging, ScaledAveraging):  # its learners all start every step at z
                module.log("crossbow/outer_lr", self.averaging.last_eta, **once)
            else:
                if self.averaging.center_is_learner_mean:
                    self.sync_center()  # gossip keeps no z while training: form it (a logging step is every rank's)
                module.log("crossbow/replica_divergence", self.stack.divergence(), **once)
            module.log("crossbow/lr", float(self.optimizers[0].param_groups[0]["lr"]), **once)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """The user's optimizer steps every replica (:meth:`_local_step`), then, at the steps where an averaging is due
        (every one with ``averaging_period=1``), the averaging rule brings the replicas and z together; replicas left
        out of it (diverged, or skipped every step since the last averaging) restart afterwards."""
        assert self.stack is not None
        self._averaging_now = self.period.due(self._ends_an_epoch) or self._average_at_step_end
        self._average_at_step_end = False
        output = self._local_step(optimizer, closure, model, **kwargs)
        diverged = self._diverged_replicas()
        skipped, self._step_skipped = self._step_skipped, None
        if self._nothing_to_step():  # (no gradient at all, as where Lightning skips the backward): all skipped
            skipped = torch.ones(self.stack.num_replicas, dtype=torch.bool, device=self.root_device)
        skipped = self.period.take_step(skipped)
        if not self._averaging_now:
            self._end_local_step(optimizer, diverged)
            return output
        if skipped is not None and self.world_size == 1 and diverged is None and bool(skipped.all()):
            # Every learner skipped (every step since the last averaging): nothing moves (not z, nor its momentum),
            # but the forwards moved the replicas' buffers (BatchNorm statistics), as plain Lightning's forward moves
            # its own.
            self.period.averaged()
            self._center_stale = True
            self._form_center_after_step()
            self._measure_throughput()
            self._log_crossbow_metrics()
            return output
        window_done = False
        if self.balancer is not None:
            self._wait_for_device()
            window_done = self.balancer.work_done()
        self._average_then_restart(optimizer, diverged, skipped)
        if self.balancer is not None:
            if window_done:
                self._rebalance()
            self._wait_for_device()
            self.balancer.sync_done()
        self._measure_throughput()
        self._log_crossbow_metrics()
        return output

    def _end_local_step(self, optimizer: Optimizer, diverged: Optional[Tensor]) -> None:
        """A step without averaging (``averaging_period > 1``): z, its buffers and its momentum stay as they are
        (gossip's z, the learners' mean, is formed when read); diverged replicas restart from z, or under gossip from
        the mean of this process's other learners (as when their peers are out of reach), their own optimizer state
        zeroed."""
        assert self.stack is not None
        if diverged is not None:
            if self.averaging.center_is_learner_mean:
                with torch.no_grad():
                    for bucket in self.stack.buckets:
                        bucket.replicas[diverged] = float("nan")  # (marked, they restart as any stranded learner)
                        restart_stranded_(bucket.replicas, bucket.center)
                self.stack.reset_buffers_(self.lightning_module, diverged)
            else:
                self.stack.reset_replicas_(self.lightning_module, diverged, buffers=True)
            reset_state_rows_(optimizer, diverged, self._stacked_leaves())
        if self.averaging.center_is_learner_mean:
            self._center_stale = True
            if self.world_size == 1:  # gossip's z, the learners' mean, after every step where it needs no collective
                self.sync_center()
        if self.balancer is not None:  # (every step is measured; a window that ends here waits for the averaging)
            self._wait_for_device()
            self.balancer.work_done()
            self.balancer.sync_done()
        self._measure_throughput()
        self._log_crossbow_metrics()

    def average_pending_steps(self) -> None:
        """Between two averagings (``averaging_period > 1``), before the learners change (a new k, a new split) and
        when fit ends (``max_time``, a callback's ``should_stop`` within an epoch), on every process alike: the
        learners' steps since the last averaging are averaged into z, as the period's last step would have (without a
        local step of its own). Those steps' batches were full (only an epoch's last, which averages, may be short)."""
        if self.stack is None or self.period.steps_since == 0:
            return
        self._take_center_shift()
        with torch.no_grad():
            self.averaging.before_local_step(self.stack.buckets, self.num_learners)
        self._average_then_restart(self.optimizers[0], None, self.period.skipped_throughout, pending=True)

    def _take_center_shift(self) -> None:
        """Between two averagings, under a rule whose learners start each period at z: a change a hook made to z
        since the last averaging moves every learner (:meth:`ReplicaStack.take_center_shift_`), before the next
        step, an averaging of the steps pending, or a checkpoint of the learners."""
        if self.stack is not None and self.averaging.learners_start_at_center and self.period.steps_since > 0:
            self.stack.take_center_shift_()

    def _average_then_restart(
        self, optimizer: Optimizer, diverged: Optional[Tensor], skipped: Optional[Tensor], pending: bool = False
    ) -> None:
        """The averaging (:meth:`_average`, ``diverged`` and ``skipped`` learners left out of it), then a new period;
        the learners left out restart (:meth:`_restart_left_out`) and z's buffers are formed."""
        dropped = diverged if skipped is None else skipped if diverged is None else diverged | skipped
        if not self._average(optimizer, dropped, pending):
            skipped = None  # every learner of every process skipped: those stay as they were (diverged ones restart)
        self.period.averaged()
        self._restart_left_out(optimizer, diverged, skipped)
        self._center_stale = True
        self._form_center_after_step()

    def _local_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]],
        **kwargs: Any,
    ) -> Any:
        """Lightning's optimizer step (through the precision plugin) on the stacked replicas. Its closure runs
        the replicas' forward and backward and then the rule's pre-step work, while the weights are still the
        pre-step ``w_j``; replicas whose ``training_step`` skipped are held out of the update."""
        assert self.stack is not None and self.engine is not None
        self._engine_trial_step = self.engine.measuring
        held: Optional[HeldRows] = None

        def closure_then_corrections() -> Any:
            nonlocal held
            with self.engine.timed():  # an engine="auto" that is still measuring times forward and backward
                result = self._forward_backward(closure)  # (which may change k, see _back_off)
            rows = self._rows_out_of_the_step()
            if rows:
                held = HeldRows(optimizer, rows)
            if self._averaging_now:
                self.averaging.before_local_step(self.stack.buckets, self.num_learners)
            return result

        lr_scale = self._layouts.learning_rate_scale() if self._layouts is not None else 1.0  # (larger batches)
        with learning_rates_scaled(optimizer, lr_scale) as self._learning_rates_outside_step:
            try:
                output = self.precision_plugin.optimizer_step(
                    optimizer, model=model or self.lightning_module, closure=closure_then_corrections, **kwargs
                )
            finally:
                self._learning_rates_outside_step = None
        if held is not None:
            held.restore_()
        self._gradients_pending = False
        return output

    def _rows_out_of_the_step(self) -> list[tuple[Tensor, Tensor]]:
        """The rows of each stacked parameter that the optimizer step leaves as they are: every row of a replica
        that skipped the step, and the rows that no backward of the step reached (the replica's loss does not
        depend on that parameter: plain Lightning's optimizer skips a parameter without a gradient)."""
        assert self.stack is not None
        skipped = self._step_skipped if self._step_skipped is not None and bool(self._step_skipped.any()) else None
        unreached = self.stack.rows_reached.unreached()
        if skipped is None and not unreached:
            return []
        rows = []
        for name, leaf in self.stack.params.items():
            mask = skipped
            if name in unreached:
                left_out = torch.tensor(unreached[name], device=leaf.device)
                mask = left_out if mask is None else mask | left_out
            if mask is not None:
                rows.append((leaf, mask))
        return rows

    def _forward_backward(self, closure: Callable[[], Any]) -> Any:
        """Lightning's closure: the replicas' ``training_step`` and backward. Where k may change (one process,
        no routing, no gradients accumulated for this k), an out-of-memory error in either undoes the attempt
        (the replicas' buffers, the step's losses, its logs) and runs the closure again with one replica fewer
        (:meth:`_back_off`), until it fits; with one replica left, the error is raised. A torchmetrics metric
        that the ``training_step`` updates, and what ``on_before_backward`` and ``on_after_backward`` log, keep
        what an attempt that failed in its backward gave them.
        """
        assert self.stack is not None
        if self.world_size > 1 or self.routing is not None or self._grouped is None or self._gradients_pending:
            return closure()  # every rank must keep the same k; accumulated gradients hold this k
        losses, skipped = self._step_losses, self._step_skipped
        while True:
            self._buffers_before_step.take(self.stack)
            try:
                return closure()
            except torch.cuda.OutOfMemoryError as error:
                self._buffers_before_step.restore_(self.stack)
                self._step_losses, self._step_skipped, self._gradients_pending = losses, skipped, False
                self._back_off(error)
            # Out of the except block, the error's traceback no longer holds the failed attempt's frames (nor
            # the activations they reference): only now can that memory go back before the next attempt.
            release_cached_memory(self.root_device)

    def _average(self, optimizer: Optimizer, dropped: Optional[Tensor], pending: bool = False) -> bool:
        """The rule's update after the local step, on the averaging stream when the replicas run on streams;
        ``dropped`` learners add nothing to it; heterogeneous mode weighs learners by their samples
        (:meth:`_learner_weights`; ``pending``: of the steps since the last averaging, without a local step of its
        own). False when nothing moved: every learner of every process left out."""
        assert self.stack is not None
        context = StepContext(
            num_learners=self.num_learners,
            step=self.lightning_module.trainer.global_step // self.period.period,  # (gossip's shift: one per period)
            epochs_done=self._epochs_done(),
            optimizer=optimizer,
            all_reduce_sum=all_reduce_sum_,
            pull_rows=pull_rows,
            dropped=dropped,
            learner_weights=self._learner_weights(pending),
            riders=self._sigterm_vote.ballot(self.root_device) if self._sigterm_vote.installed else None,
            single_process=self.world_size == 1,
        )
        with torch.no_grad(), self._averaging_stream():
            moved = self.averaging.after_local_step(self.stack.buckets, context)
        if context.riders is not None:
            self._sigterm_vote.count(context.riders)
        return moved

    def _restart_left_out(self, optimizer: Optimizer, diverged: Optional[Tensor], skipped: Optional[Tensor]) -> None:
        """Diverged replicas restart from z with their per-replica optimizer state zeroed; replicas that skipped, from
        z. (Gossip's left-out learners already took their peers' weights.)"""
        assert self.stack is not None
        if diverged is not None:
            if not self.averaging.center_is_learner_mean:
                self.stack.reset_replicas_(self.lightning_module, diverged, buffers=True)
            else:  # (gossip: the weights came from a peer, or restarted; the buffers restart from z's)
                self.stack.reset_buffers_(self.lightning_module, diverged)
            reset_state_rows_(optimizer, diverged, self._stacked_leaves())
        if skipped is not None and not self.averaging.center_is_learner_mean:
            self.stack.reset_replicas_(self.lightning_module, skipped, buffers=False)

    def _expose_mean_gradients(self) -> None:
        """While the module or a callback may read gradients
        (:func:`~lightning_crossbow.gradients.hooks_read_gradients`), the module's parameters carry the replicas'
        mean gradient (:class:`~lightning_crossbow.gradients.MeanGradients`); nothing is paid otherwise."""
        assert self.stack is not None
        if self._mean_gradients is not None:
            self._mean_gradients.remove()
        self._mean_gradients = (
            MeanGradients(self.lightning_module, self.stack.params) if self._reads_gradients else None
        )

    def _show_gradients_zeroed_with_the_replicas(self, optimizer: Optimizer) -> None:
        """When the optimizer's ``zero_grad`` clears (or zeroes) the replicas' gradients, the module's parameters show
        it too, as in plain Lightning, where they are the gradients ``zero_grad`` clears. (An attribute of this
        optimizer instance, removed at teardown.)"""
        zero_grad = type(optimizer).zero_grad

        def zero_grad_shown(*args: Any, **kwargs: Any) -> None:
            zero_grad(optimizer, *args, **kwargs)
            if self._mean_gradients is not None:
                self._mean_gradients.refresh()

        optimizer.zero_grad = zero_grad_shown  # type: ignore[method-assign]

    def _refresh_mean_gradients_before_hooks(self) -> None:
        """A gradient scaler unscales the replicas' gradients between backward and ``on_before_optimizer_step``:
        the precision plugin's ``_after_closure`` (those hooks, then clipping) sets the mean gradients again
        first. What ``on_before_optimizer_step`` and then ``configure_gradient_clipping`` change in them goes to
        the replicas before and after the clipping (:meth:`MeanGradients.apply_changes_`). (Attributes of this plugin
        instance, removed at teardown.)"""
        plugin = self.precision_plugin
        after_closure, configured_clipping = type(plugin)._after_closure, type(plugin)._clip_gradients
        clip_gradients = type(plugin).clip_gradients

        def refreshed_then_after_closure(model: "pl.LightningModule", optimizer: Any) -> None:
            if self._mean_gradients is not None and getattr(plugin, "scaler", None) is not None:
                self._mean_gradients.refresh()  # (only a scaler changed the stacked gradients since they were shown)
            after_closure(plugin, model, optimizer)

        def configured_clipping_with_changes_applied(*args: Any, **kwargs: Any) -> None:
            if self._mean_gradients is not None:
                self._mean_gradients.apply_changes_()
            configured_clipping(plugin, *args, **kwargs)
            if self._mean_gradients is not None:
                self._mean_gradients.apply_changes_()

        def changes_applied_then_clipped(*args: Any, **kwargs: Any) -> None:  # (self.clip_gradients)
            if self._mean_gradients is not None:
                self._mean_gradients.apply_changes_()  # (what configure_gradient_clipping changed before it)
            clip_gradients(plugin, *args, **kwargs)
            if self._mean_gradients is not None:
                self._mean_gradients.refresh()  # (the clipped replicas' mean)

        plugin._after_closure = refreshed_then_after_closure  # type: ignore[method-assign]
        plugin._clip_gradients = configured_clipping_with_changes_applied  # type: ignore[method-assign]
        plugin.clip_gradients = changes_applied_then_clipped  # type: ignore[method-assign]

    def _wait_for_device(self) -> None:
        """The balancer times this rank's work on the host: on CUDA, wait for the queued kernels first."""
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)

    def _make_engine(self, replicas_per_device: int, fused_failed: bool = False) -> Engine:
        """The configured engine for k replicas (an auto engine whose fused attempt failed does not try again).

        In heterogeneous mode ``engine="auto"`` is fused with its fallback, never timed against streams: the ranks
        hold different k and change it at different steps, so they could not time their candidates together."""
        measured_choice = not (self.balancer is not None and self.engine_name == "auto")
        return make_engine(
            self.engine_name,
            self.lightning_module,
            replicas_per_device,
            self._stream_pool() if measured_choice else None,
            fused_failed,
            self._all_reduce_sum,
            fastest=self._fastest_engine.get(replicas_per_device),
        )

    def _renew_engine(self, replicas_per_device: int) -> None:
        """A new engine for the stack as it now is, with ``replicas_per_device`` replicas; an auto engine's choice
        for the current k is remembered (it is not measured again when k comes back), and a failed fused attempt is
        not tried again."""
        assert self.engine is not None
        if isinstance(self.engine, FastestEngine) and self.engine.chosen is not None:
            self._fastest_engine[self.replicas_per_device] = self.engine.chosen
        self.engine = self._make_engine(replicas_per_device, fused_failed=self.engine.fused_failed)

    def _stream_pool(self) -> Optional[StreamPool]:
        """The CUDA streams of this rank's device (the accelerator's pool), or None off CUDA."""
        if self.root_device.type != "cuda":
            return None
        if isinstance(self.accelerator, CrossbowAccelerator):
            return self.accelerator.stream_pool(self.root_device)
        if self._own_stream_pool is None or self._own_stream_pool.device != self.root_device:
            self._own_stream_pool = StreamPool(self.root_device)
        return self._own_stream_pool

    def _averaging_stream(self) -> ContextManager[Any]:
        """With the replicas on CUDA streams, the averaging runs on the pool's synchronisation stream."""
        assert self.engine is not None
        pool = self._stream_pool()
        return pool.on_sync_stream() if pool is not None and self.engine.uses_streams else nullcontext()

    def _learner_weights(self, pending: bool = False) -> Optional[Tensor]:
        """``K p_i`` of the local learners where the learners' samples since the last averaging differ (heterogeneous
        mode: a short batch, or ranks' batch sizes that differ), else None. ``pending``: for the steps since the last
        averaging, averaged before the learners change (all of them steps of full batches at the layout in force)."""
        if self._layouts is None or not isinstance(self._grouped, RoutedBatchLoader):
            return None
        weights = self._layouts.learner_weights(self._grouped.current_group, self.period.steps_since, pending)
        if weights is None:
            return None
        return torch.tensor(weights, dtype=torch.float64, device=self.root_device)  # (each bucket takes its dtype)

    def replica_room(self) -> int:
        """How many more replicas fit on every rank: each must fit twice over in the device's free memory (RAM on
        CPU; activations are not counted). A collective: every rank calls it at the same step."""
        return int(self._all_gather_rows(torch.tensor([float(self._room_for_learners())]))[:, 0].min())

    def _room_for_learners(self) -> int:
        """How many more learners this rank may take: each must fit twice over in the device's free memory (RAM on
        CPU), as for the tuner (activations are not counted)."""
        assert self.stack is not None
        free = device_memory(self.root_device)["memory_free_bytes"]
        if self.root_device.type == "cpu":
            free /= max(self.num_processes, 1)  # the processes on this machine share its RAM
        return min(int(free // (2 * self.stack.state_bytes_per_replica())), 1 << 20)

    def _gather_objects(self, local: Any) -> list[Any]:
        """Every process's ``local`` (picklable), in rank order. A collective on several processes."""
        if self.world_size == 1:
            return [local]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, local)
        return gathered

    def check_epoch_steps_agree(self, trainer: "pl.Trainer") -> None:
        """Across processes, as each training epoch starts: every process must take the epoch's steps, each of which
        ends in collectives that all of them join. Per-rank loaders of different lengths
        (``use_distributed_sampler=False``) would leave the longer epochs' processes waiting, at the shorter one's
        end, for the process group's timeout; the counts are gathered (one collective an epoch) and a mismatch raises
        on every process. Not in heterogeneous mode, whose routed loaders take their steps from one common order."""
        if self.world_size == 1 or self.routing is not None:
            return
        steps = trainer.num_training_batches
        counts = self._gather_objects(steps)
        if any(count != steps for count in counts):
            per_rank = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
            raise RuntimeError(
                f"crossbow: the processes' training epochs have different numbers of steps ({per_rank}; k="
                f"{self.replicas_per_device} batches a step). Every process takes every step, so every process's"
                " training DataLoader must give the same number of batches: let Lightning shard one dataset"
                " (use_distributed_sampler=True, the default), or give each process a loader of the same length."
            )

    def _gather_to_rank_zero(self, local: Any) -> Optional[list[Any]]:
        """Every process's ``local`` (picklable), in rank order, on rank 0; None elsewhere. A collective."""
        if self.world_size == 1:
            return [local]
        gathered: Optional[list[Any]] = [None] * self.world_size if self.global_rank == 0 else None
        torch.distributed.gather_object(local, gathered, dst=0)
        return gathered

    def _all_gather_rows(self, row: Tensor) -> Tensor:
        """:func:`all_gather_rows` through the root device (NCCL's collectives take CUDA tensors only), on the CPU."""
        return all_gather_rows(row.to(self.root_device)).cpu()

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """:func:`all_reduce_sum_` through the root device (NCCL's collectives take CUDA tensors only), on the CPU."""
        return all_reduce_sum_(tensor.to(self.root_device)).cpu()

    def _rebalance(self) -> None:
        """Ends the balancer's window: every rank moves to the same new layout, if one pays, at the same group, and
        Lightning's count of the epoch's steps follows."""
        assert self._layouts is not None and isinstance(self._grouped, RoutedBatchLoader) and self.stack is not None
        trainer = self.lightning_module.trainer
        room = self._room_for_learners()
        scheduled = self._layouts.rebalance(self._grouped, room, self._all_gather_rows, trainer.global_step)
        if scheduled is not None:
            self._epoch.k_changed(trainer, self.stack.num_replicas)
            self._layouts.report(*scheduled, self._grouped)

    def _ends_an_epoch(self) -> bool:
        """Whether this step is the last of its epoch (also of a loader without a length: the batch Lightning fetched
        ahead found none after it), or of training (``max_steps``)."""
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return (
            progress.current.ready >= trainer.num_training_batches
            or progress.is_last_batch
            or trainer.global_step + 1 == trainer.max_steps
        )

    def _epochs_done(self) -> float:
        """Training epochs completed once this step ends, fractional: the clock of the warm-up."""
        trainer = self.lightning_module.trainer
        batches = trainer.num_training_batches
        done_in_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return trainer.current_epoch + (done_in_epoch / batches if math.isfinite(batches) and batches else 0.0)

    def _diverged_replicas(self) -> Optional[Tensor]:
        losses, self._step_losses = self._step_losses, None
        if losses is None or all(map(math.isfinite, losses.tolist())):  # (one read of k numbers, no tensor ops)
            return None
        diverged = ~losses.isfinite()
        step = self.lightning_module.trainer.global_step
        for replica in diverged.nonzero().flatten().tolist():
            warnings.warn(
                f"crossbow: replica {replica} on rank {self.global_rank} has a non-finite loss"
                f" ({losses[replica].item()}) at step {step}; it is reset to the central model and its own optimizer"
                " state (momentum, moments) zeroed; state its replicas share, such as Adam's step count, goes on."
                " Training continues.",
                stacklevel=2,
            )
        return diverged

    def _measure_throughput(self) -> None:
        if self._step_started is None:
            return
        elapsed = time.perf_counter() - self._step_started
        batch_size = self._layouts.own_batch_size() if self._layouts is not None else self._batch_size
        if elapsed > 0 and batch_size:
            rate = self.replicas_per_device * batch_size / elapsed
            previous = self.samples_per_second
            self.samples_per_second = rate if previous is None else 0.9 * previous + 0.1 * rate
            if isinstance(self.accelerator, CrossbowAccelerator):
                self.accelerator.samples_per_second = self.samples_per_second

    # ----------------------------------------------------------------- z's buffers and hooks
    def sync_center(self) -> None:
        """z's buffers (BatchNorm statistics, ...) <- the mean over all replicas of all processes; and z's
        parameters too for rules that keep no z during training (gossip). A no-op when nothing changed."""
        if self.stack is None or not self._center_stale:
            return
        reduce = self._all_reduce_mean if self.world_size > 1 else None
        with torch.no_grad():
            if self.averaging.center_is_learner_mean:
                for bucket in self.stack.buckets:
                    mean = bucket.replicas.mean(0)
                    bucket.center.copy_(mean if reduce is None else reduce(mean))
            self.stack.sync_center_buffers_(reduce)
        self._center_stale = False

    def _form_center_after_step(self) -> None:
        """After every averaging (every optimizer step with ``averaging_period=1``), what callbacks, hooks and the
        module itself read is z, as the averaging left it: z's buffers (the replicas' mean) and, for gossip, z's
        parameters (the learners' mean). On one process always (no collective needed). Across processes: z's buffers
        at every averaging, in one all-reduce per floating dtype (integer buffers ride as float64), as DDP
        broadcasts its buffers at every step; gossip, which has no all-reduce of its own, forms z and its buffers at
        every epoch's end and the last step (and when read)."""
        assert self.stack is not None
        if self.world_size == 1 or (self.averaging.center_is_learner_mean and self._ends_an_epoch()):
            self.sync_center()
        elif not self.averaging.center_is_learner_mean:
            self.stack.sync_center_buffers_(self._all_reduce_mean)
            self._center_stale = False  # (z itself: the averaging's own, in place)

    def _all_reduce_mean(self, tensor: Tensor) -> Tensor:
        """The mean over every process's learners of ``tensor``, this process's mean over its own (in place)."""
        if self.routing is not None:  # ranks hold different numbers of learners: weigh each rank's mean by them
            assert self.stack is not None
            return all_reduce_sum_(tensor.mul_(self.stack.num_replicas)).div_(self.num_learners)
        return all_reduce_sum_(tensor).div_(self.world_size)

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:  # (a check of this epoch done)
            self._epoch.validation_started()
            self._release_gradients_as_the_module_did(trainer)
        self.sync_center()

    def _release_gradients_as_the_module_did(self, trainer: "pl.Trainer") -> None:
        """Before a validation within fit Lightning releases the module's gradients (``on_validation_model_zero_grad``,
        unless it is accumulating them); the replicas' gradients, which crossbow keeps, go too, so that an optimizer
        step without a backward after it (``StochasticWeightAveraging``'s BatchNorm epoch) finds none, as plain
        Lightning's finds none. Where the module overrides that hook, its gradients are its own business."""
        if self.stack is None or is_overridden("on_validation_model_zero_grad", self.lightning_module):
            return
        if not trainer.fit_loop.epoch_loop._should_accumulate():  # (Lightning zeroes nothing then)
            self.stack.release_gradients_()

    @override
    def on_test_start(self) -> None:
        self.sync_center()

    @override
    def on_predict_start(self) -> None:
        self.sync_center()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        loaders = self.lightning_module.trainer.train_dataloader
        if not isinstance(loaders, ReplicaBatchLoader):
            count = len(loaders) if isinstance(loaders, Sized) else "several"
            raise ValueError(
                "crossbow trains on one training DataLoader, given as it is, whose consecutive batches it groups k at"
                f" a time; got a {type(loaders).__name__} of {count} loader(s). Pass one DataLoader itself (not in a"
                " list or dict); combine several into one (for example over a ConcatDataset), or train with another"
                " strategy."
            )
        assert self.stack is not None
        self._epoch.align_the_resumed_epoch(self.lightning_module.trainer, self.stack.num_replicas)
        self.stack.take_center_param_changes_(self.lightning_module)  # (what on_fit_start, on_train_start set)
        if self.balancer is not None:
            self.balancer.resume_window()

    @override
    def on_train_end(self) -> None:
        trainer = self.lightning_module.trainer
        ran_to_its_end = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # (also where max_steps ends there)
        if self._grouped is not None and (ran_to_its_end or not 0 <= trainer.max_steps <= trainer.global_step):
            self._grouped.draw_tail()  # the last epoch ran to its end: plain Lightning drew every batch of it
        self.average_pending_steps()
        self.sync_center()
        # Teardown frees the replicas; keep their state (on the CPU) for a checkpoint saved after fit.
        self._keep_final_state()
        self._sigterm_vote.stop_if_any_signalled(self.root_device, all_reduce_sum_)

    # ------------------------------------------------------------------ the user's collectives
    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._refuse_collectives_of_uneven_replicas("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self._refuse_collectives_of_uneven_replicas("reduce")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_collectives_of_uneven_replicas("broadcast")
        return super().broadcast(obj, src=src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_collectives_of_uneven_replicas("barrier")
        super().barrier(*args, **kwargs)

    def _refuse_collectives_of_uneven_replicas(self, name: str) -> None:
        """In heterogeneous mode a collective of the user's inside ``training_step`` (``self.all_gather``, say) is
        refused: each process runs its own number of replicas a step, one after another where the step does not
        run fused, so their collectives would not pair up across processes and every process would wait for the
        others for good. (In uniform mode replica j of every process meets replica j of the others.)"""
        if self._running_replica_steps and self.routing is not None and self.world_size > 1:
            raise RuntimeError(
                f"crossbow: training_step called the strategy's {name} (self.{name}, say) under heterogeneous=True,"
                " where each process runs its own number of replicas a step (the split follows the measured speeds):"
                " the replicas' collectives would not pair up across processes, and every process would wait for"
                " the others until the timeout. Make the collective outside training_step (on_train_batch_end, say),"
                " or train with heterogeneous=False (there replica j of every process meets replica j of the others)."
            )

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._replicas_in_module:
            raise RuntimeError(
                "crossbow: a checkpoint was saved inside training_step, where the module holds the learners' weights"
                f" ({self.num_learners} learners run the step), not the central model that a checkpoint holds. Save it"
                " from a hook after the step: on_train_batch_end, or a callback such as"
                " ModelCheckpoint(every_n_train_steps=...)."
            )
        self.sync_center()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if "optimizer_states" in checkpoint:  # (a weights-only checkpoint holds z alone, as plain Lightning's)
            state = self._strategy_state() if self.stack is not None else self._final_state  # from every rank
            if state is not None and self.stack is None:
                state = self._with_center_changed_since_fit(state, checkpoint)
            if state is not None:
                checkpoint[_CHECKPOINT_KEY] = state
            if state is not None and state["world_size"] > 1 and state["ranks"] is not None:  # (rank 0, which writes)
                rows = state["split"] or (state["replicas_per_device"],) * state["world_size"]
                ranks = [rank["optimizer"] for rank in state["ranks"]]
                checkpoint["optimizer_states"] = [
                    central_state_over_ranks(
                        checkpoint["optimizer_states"][0], ranks, rows, self._stacked_indices(self.optimizers[0])
                    )
                ]
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state over the module's own parameters, the mean over this process's replicas (the
        checkpoint holds the mean over every process's, see :meth:`save_checkpoint`): the checkpoint's
        ``optimizer_states`` resume in plain Lightning too, and seed the replicas of a resume with another k or
        world size. Each rank's stacked state is kept beside it."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = central_state_dict(optimizer, self._stacked_leaves())  # this process's; see save_checkpoint
        with_learning_rates(state, self._learning_rates_outside_step)  # (a checkpoint saved inside a step)
        for index in self._unfused_groups:  # (as the user made it: plain Lightning, or k=1, runs it fused)
            state["param_groups"][index]["fused"] = True
        return state

    def _stacked_leaves(self) -> list[Tensor]:
        """The stacked ``(k, *shape)`` leaves that the optimizer steps (the last fit's, after it)."""
        return list(self.stack.params.values()) if self.stack is not None else self._leaves_after_fit

    def _stacked_indices(self, optimizer: Optimizer) -> list[int]:
        """The positions of the stacked leaves in ``optimizer``'s state_dict order (:func:`stacked_indices`)."""
        return stacked_indices(optimizer, self._stacked_leaves())

    def _strategy_state(self) -> dict[str, Any]:
        assert self.stack is not None
        self._take_center_shift()  # (the learners saved hold a hook's change to z since the last averaging)
        if self.averaging.learners_start_at_center and not self._gradients_pending and self.period.steps_since == 0:
            self.stack.reset_replicas_(self.lightning_module)  # where the next step puts them anyway
        local: dict[str, Any] = {
            "stack": self.stack.state_dict(),
            # heterogeneous mode: the balancer's measurements, history and this rank's window
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
            "optimizer": apply_to_collection(  # stacked
                with_learning_rates(self.optimizers[0].state_dict(), self._learning_rates_outside_step),
                Tensor,
                _cpu_copy,
            ),
        }
        ranks = self._gather_to_rank_zero(local)  # only rank 0 writes checkpoints: the others hold their own alone
        in_flight = self._batches_in_flight()
        return {
            "version": _CHECKPOINT_VERSION,
            "algorithm": self.algorithm,
            "replicas_per_device": self.replicas_per_device,
            # the k the strategy was made with: a resume made alike carries on with a k changed during fit
            "configured_replicas_per_device": self._configured_replicas_per_device,
            # the k of the next group, when a change of k is under way (the replicas follow at that group)
            "next_replicas_per_device": (
                self._grouped.num_replicas if self._grouped is not None and self.routing is None else None
            ),
            # the epoch's groups and batches so far, for a loader that resumes mid-epoch (ReplicaBatchLoader)
            "pass_counts": (
                [self._grouped.groups_yielded, self._grouped.batches_taken]
                if self._grouped is not None and self.routing is None
                else None
            ),
            # the batches of the last group counted there if its step has not ended (a save from an exception)
            "batches_in_flight": in_flight,
            # heterogeneous mode: the epoch's groups and samples of the common order trained so far (the same on
            # every rank), where a resume in the epoch's middle goes on
            "routed_place": (
                list(self._grouped.place_in_pass(in_flight > 0))
                if isinstance(self._grouped, RoutedBatchLoader)
                else None
            ),
            # the epoch's fractional validation checks done (EpochCounts.time_fractional_validation), that of a step
            # that ended counted in: a resumed fit goes on from the next step, as plain Lightning does, skipping its
            # check
            "validation_checks_done": self._epoch.checks_to_save(step_ended=not in_flight),
            "replica_ceiling": self.replica_ceiling,  # set by an out-of-memory back-off
            # heterogeneous mode: the learners per rank and each rank's per-replica batch size, in force and in a
            # change scheduled (by the balancer or set_replicas_per_device) and not in force yet (LearnerLayouts)
            **(
                self._layouts.checkpoint_entries(in_flight > 0)
                if self._layouts is not None
                else dict.fromkeys(("split", "next_split", "batch_sizes", "batch_sizes_of_loader", "next_batch_sizes"))
            ),
            "world_size": self.world_size,
            "last_lrs": self._last_lrs,
            "lrs_before_last": self._lrs_before_last,
            "averaging": self.averaging.state_dict(),
            # optimizer steps since the last averaging (averaging_period > 1): the replicas hold their steps since
            "steps_since_averaging": self.period.steps_since,
            # a drop of the lr seen since, whose reset of the replicas waits for the next averaging
            "lr_drop_pending": self._lr_drop_pending,
            "ranks": ranks,
        }

    def _batches_in_flight(self) -> int:
        """Batches of a group drawn for a step that Lightning has not counted processed (a checkpoint saved from an
        exception raised in the step, or before it, in a hook), else 0."""
        grouped = self._grouped
        if grouped is None:
            return 0
        fit_loop = self.lightning_module.trainer.fit_loop
        progress = fit_loop.epoch_loop.batch_progress.current
        if self.routing is not None:  # (Lightning's count: a routed loader, never fetched ahead, counts from a place)
            handed_out = progress.ready
        else:
            ahead = len(getattr(fit_loop._data_fetcher, "batches", ()))  # (fetched ahead: no length)
            handed_out = grouped.groups_yielded - ahead
        return grouped.last_group_batches if handed_out > progress.processed else 0

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; notes what each entry holds as loaded, before ``on_load_checkpoint`` may edit it. (The
        other arguments, ``weights_only`` since Lightning 2.6, go to Lightning's.)"""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._checkpoint_marks = checkpoint_marks(checkpoint)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores every replica, its optimizer state and z_prev; re-seeds from z when k or world size differ."""
        self._load_replicas_and_optimizer(checkpoint)
        self._unfuse_for_replicas(self.optimizers[0])  # (the checkpoint's param groups may ask for fused kernels)
        assert self.stack is not None
        self.stack.note_center_params()  # (a hook's changes since, at on_train_start)

    def _load_replicas_and_optimizer(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.stack is not None
        state = checkpoint.get(_CHECKPOINT_KEY)
        optimizer = self.optimizers[0]
        # (none in a checkpoint saved before configure_optimizers made the optimizer: a fit that failed there)
        saved_optimizer = checkpoint["optimizer_states"][0] if checkpoint.get("optimizer_states") else None
        counts = state.get("pass_counts") if state is not None else None
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        # The groups and batches drawn, and those trained: a group drawn for a step that did not end (a checkpoint
        # saved from an exception, as OnExceptionCheckpoint's) is not, and plain Lightning trains its batch again.
        # (A checkpoint of plain Lightning, or of k=1, trained one batch per step.)
        if counts:
            drawn, in_flight = (counts[0], counts[1]), state.get("batches_in_flight", 0)
            trained = (counts[0] - 1, counts[1] - in_flight) if in_flight else drawn
        else:
            drawn, trained = (progress.ready, progress.ready), (progress.processed, progress.processed)
        self._resumed_pass_counts, self._resumed_pass_trained = drawn, trained
        self._epoch.restore(state.get("validation_checks_done", 0) if state is not None else 0)
        if self.routing is None and self._loader_made_before_the_restore():
            # Its loader was made before this restore (estimated_stepping_batches in configure_optimizers), its
            # iterator too, and Lightning will not load its position (nor does plain Lightning then). (A loader
            # that Lightning makes again when the epoch starts takes the counts then.)
            self._count_on_from_the_checkpoint(self._fit_loader, trained, pass_begun=True, step_ended=trained == drawn)
            self._resumed_pass_counts = self._resumed_pass_trained = None
        saved_layout = state["ranks"][0]["stack"].get("names") if state is not None else None
        without_replicas = {name for name, _ in self._without_replicas}
        regained = [names for names in saved_layout or [] if names and all(name in without_replicas for name in names)]
        if regained:  # parameters that got replicas once unfrozen get them again, in the buckets they had
            self._give_replicas_to(regained)
        if self.routing is not None:
            same_layout = self._restore_split(state)
            self._restore_routed_place(state, step_ended=trained == drawn)
        else:
            # (a heterogeneous run's checkpoint with different learners per rank re-seeds)
            even = state is not None and len(set(state.get("split") or (0,))) == 1
            ceiling = state.get("replica_ceiling") if state is not None else None
            if ceiling is not None:  # the run backed off after running out of memory: it stays below
                self.replica_ceiling = min(ceiling, self.replica_ceiling or ceiling)
            carry_on = self._carries_on_the_k_of(state) or (ceiling is not None and self.replicas_per_device > ceiling)
            if even and carry_on and state["replicas_per_device"] != self.replicas_per_device:
                self._resize_replicas(state["replicas_per_device"])  # a tuned, or backed-off, k (per device) carries on
            if even and carry_on and state.get("next_replicas_per_device") not in (None, state["replicas_per_device"]):
                self._resumed_group_size = state["next_replicas_per_device"]  # a change of k under way goes on
            same_layout = (
                even
                and state["replicas_per_device"] == self.replicas_per_device
                and state["world_size"] == self.world_size
            )
        same_layout = same_layout and saved_layout in (None, self.stack.layout)
        if state is not None and state.get("algorithm", self.algorithm) == self.algorithm:
            self.averaging.load_state_dict(state.get("averaging", {}))
        elif state is not None:
            rank_zero_warn(
                f"crossbow: the checkpoint was trained with algorithm={state['algorithm']!r} and training goes on"
                f" with algorithm={self.algorithm!r}: z, the replicas and their optimizer state carry on, and"
                f" {self.algorithm!r} starts its own state afresh (for scaled averaging, the measured gain)."
            )
        if same_layout:
            rank_state = state["ranks"][self.global_rank]
            marks = self._checkpoint_marks or {}
            if saved_optimizer is None and marks.get(("optimizer_states",)):
                pass  # (a hook emptied optimizer_states: the optimizer starts afresh, as in plain Lightning)
            else:
                optimizer.load_state_dict(rank_state.get("optimizer", saved_optimizer))
            if saved_optimizer is not None and "optimizer" in rank_state:
                take_central_settings_(optimizer, saved_optimizer)
            self.stack.load_state_dict(rank_state["stack"])
            # z's buffers were restored before the set-up made the replicas: what changed them since is a hook's
            # (on_fit_start's), which the loaded replicas take; their own buffers otherwise go on.
            self.stack.take_center_buffer_changes_()
            self._take_edits_of_the_checkpoint(checkpoint, optimizer)
            self._last_lrs, self._lrs_before_last = state["last_lrs"], state.get("lrs_before_last")
            self.period.restart(state.get("steps_since_averaging", 0))
            self._lr_drop_pending = state.get("lr_drop_pending", False)
            self._center_stale = True
            return
        if saved_optimizer is None:  # nothing trained: the replicas, copies of the checkpoint's z, start afresh
            return
        if len(saved_optimizer["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"crossbow: the checkpoint's optimizer has {len(saved_optimizer['param_groups'])} param group(s) and"
                f" this run's has {len(optimizer.param_groups)}. A callback or hook that added param groups in the run"
                " that saved it (such as BaseFinetuning) must be given again when resuming; plain Lightning refuses"
                " this checkpoint too."
            )
        seeded = seed_stacked_state_(optimizer, saved_optimizer, self._stacked_leaves())
        if not seeded:
            for group, saved_group in zip(optimizer.param_groups, saved_optimizer["param_groups"], strict=True):
                group.update({key: value for key, value in saved_group.items() if key != "params"})
        if state is not None:
            self.stack.load_state_dict(state["ranks"][0]["stack"], replicas=False)
            self._last_lrs, self._lrs_before_last = state["last_lrs"], state.get("lrs_before_last")
        split, saved_world = (tuple(state.get("split") or ()), state["world_size"]) if state is not None else ((), 0)
        where = (
            "a checkpoint without crossbow state"
            if state is None
            else (
                f"a checkpoint of {sum(split)} learners split {split} over world_size={saved_world}"
                if len(set(split)) > 1  # (heterogeneous mode's learners per rank)
                else f"a checkpoint of replicas_per_device={state['replicas_per_device']} x world_size={saved_world}"
            )
            + (
                ""
                if saved_layout in (None, self.stack.layout)
                else f" whose replicas lie in other flat buffers ({saved_layout}, here {self.stack.layout})"
            )
        )
        optimizer_state = (
            "every replica's optimizer state is the checkpoint's (its mean over replicas, if it had several)"
            if seeded
            else "their optimizer state starts fresh (it did not match the parameters; learning rates and other"
            " hyper-parameters were restored)"
        )
        pending = state.get("steps_since_averaging", 0) if state is not None else 0
        rank_zero_warn(
            f"crossbow: resuming from {where} with replicas_per_device={self.replicas_per_device} x"
            f" world_size={self.world_size}: the replicas were re-seeded from the central model and {optimizer_state}."
            + (
                f" It was saved {pending} optimizer step(s) after its last averaging (averaging_period): the replicas'"
                " steps since, which the central model had not taken in, are not carried on."
                if pending
                else ""
            )
        )

    def _take_edits_of_the_checkpoint(self, checkpoint: Mapping[str, Any], optimizer: Optimizer) -> None:
        """The replicas and their optimizer state, loaded from crossbow's own copies, take what a hook edited in the
        checkpoint's ``state_dict`` and ``optimizer_states`` since it was loaded (``on_load_checkpoint`` resetting a
        head, BatchNorm's statistics or a momentum), and the module's weights that changed after the fit that saved
        it (``center_changed``), as plain Lightning trains from the entries the file holds."""
        assert self.stack is not None
        changed_after_fit = (checkpoint.get(_CHECKPOINT_KEY) or {}).get("center_changed") or []
        marks, self._checkpoint_marks = self._checkpoint_marks, None
        if marks is None:  # (a checkpoint given otherwise than through load_checkpoint: nothing known of edits)
            self.stack.take_center_values_(changed_after_fit)
            return
        state_dict = checkpoint.get("state_dict") or {}
        self.stack.take_center_values_(
            [name for name, value in state_dict.items() if edited(marks.get(("state_dict", name)), value)]
            + changed_after_fit
        )
        if checkpoint.get("optimizer_states"):
            take_edited_state_(optimizer, checkpoint["optimizer_states"][0]["state"], marks, self._stacked_leaves())

    def _carries_on_the_k_of(self, state: Optional[Mapping[str, Any]]) -> bool:
        """Whether a resume goes on with the checkpoint's k (instead of re-seeding the replicas at this strategy's):
        where k is tuned, or where this strategy was made with the k of the one that saved it (a k changed during
        that fit, by hand, carries on, as in the run that went on). A strategy made with another k re-seeds at it."""
        return self.restore_replicas_per_device or (
            state is not None and state.get("configured_replicas_per_device") == self._configured_replicas_per_device
        )

    def _restore_routed_place(self, state: Optional[Mapping[str, Any]], step_ended: bool) -> None:
        """Heterogeneous mode, resumed in an epoch's middle: the epoch goes on at the checkpoint's place in the common
        order, whatever the learners and batch sizes are now (the order is the same for any split and world size)."""
        if state is None or not self._resumes_in_an_epochs_middle(step_ended):
            return
        place = state.get("routed_place")
        if place is None:
            self._routed_place_unknown = True  # (the uniform path's, or an earlier version's)
            return
        trainer = self.lightning_module.trainer
        epoch = trainer.fit_loop.epoch_progress.current.processed
        self._epoch.follows_k = True  # (the epochs after the resumed one are counted again as they start)
        if self._loader_made_before_the_restore():  # (configure_optimizers read estimated_stepping_batches)
            assert isinstance(self._fit_loader, RoutedBatchLoader) and self.stack is not None
            self._fit_loader.resume_pass_at(epoch, *place)
            self._epoch.fit_epoch_length(trainer, self.stack.num_replicas)  # (Lightning counted before the restore)
        else:
            self._resumed_routed_place = (epoch, int(place[0]), int(place[1]))

    def _loader_made_before_the_restore(self) -> bool:
        """Whether this fit's training loader was made before the checkpoint's restore (in ``configure_optimizers``,
        for ``estimated_stepping_batches``) and is the one that trains next (not made again when the resumed epoch
        starts, by ``reload_dataloaders_every_n_epochs``)."""
        return self._fit_loader is not None and not self.lightning_module.trainer.fit_loop._should_reload_train_dl

    def _restore_split(self, state: Optional[Mapping[str, Any]]) -> bool:
        """Heterogeneous mode: carries on with the checkpoint's learners per rank where it can
        (:meth:`LearnerLayouts.restore`); returns whether it did."""
        assert self._layouts is not None and self.stack is not None
        if state is None:
            return False
        split = self._layouts.restore(state, self._carries_on_the_k_of(state), self.num_learners)
        if split is None:
            return False
        # Lightning may have counted the epoch's steps at an even split already (a loader made in configure_optimizers,
        # for estimated_stepping_batches): each epoch's count follows the restored learners and batch sizes, the
        # resumed one's too, also where it resumes in its middle
        self._epoch.follows_k = self._epoch.recount_at_next_batch = True
        if self._loader_made_before_the_restore():
            self._layouts.check_restored_batch_sizes()  # (done as the loader is made, otherwise)
        if split[self.global_rank] != self.stack.num_replicas:
            self._resize_replicas(split[self.global_rank])
        return True

    # ------------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        if self.stack is not None and self._final_state is None:
            self._keep_state_of_a_failed_fit()
        if self._layouts is not None:  # a later fit starts from the mean k at an even split, on every rank alike
            self.replicas_per_device = self.tuned_replicas_per_device
            self._layouts = None
        if self._mean_gradients is not None:
            self._mean_gradients.remove()
            self._mean_gradients = None
        self._sigterm_vote.uninstall()
        self._checkpoint_marks = None
        if self.stack is not None:  # (a checkpoint saved after fit reads the optimizer, still over them)
            self._leaves_after_fit = list(self.stack.params.values())
            self.stack.release_center()  # (z's parameters, views of flat buffers, each its own tensor again)
        self.stack = None
        self.engine = self._sequential_forwards = None
        self._step_losses = self._step_skipped = None
        self._gradients_pending = False  # (a fit may stop between two accumulated batches)
        self._group = self._group_cut = None  # (a fit may stop by an error in a step)
        # (a fit may stop before its loader was made)
        self._resumed_group_size = self._resumed_pass_counts = self._resumed_pass_trained = None
        self._resumed_routed_place, self._routed_place_unknown = None, False
        self._epoch.end_fit(self._lightning_module.trainer if self._lightning_module is not None else None)
        if self._grouped is not None:
            self._grouped.forget_tail()
        if self._k_next_group is not None:  # a change of k under way when fit ended: the next fit's k
            self.replicas_per_device, self._k_next_group = self._k_next_group, None
        self._log_capture.clear()
        self._buffers_before_step.clear()
        for patched in ("clip_grad_by_norm", "_after_closure", "_clip_gradients", "clip_gradients"):
            vars(self.precision_plugin).pop(patched, None)
        for optimizer in self.optimizers:
            vars(optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer).pop(
                "zero_grad", None
            )
        if self._lightning_module is not None:
            vars(self._lightning_module).pop("_on_before_batch_transfer", None)
        super().teardown()

    def _keep_final_state(self) -> None:
        """Keeps the replicas' state for a checkpoint saved after fit, and the module's state it belongs to."""
        self._final_state = self._strategy_state() if self.stack is not None else None
        state_dict = self.lightning_module.state_dict()  # (extra state that is no tensor is left out)
        self._center_after_fit = {
            name: _cpu_copy(value) for name, value in state_dict.items() if isinstance(value, Tensor)
        }

    def _with_center_changed_since_fit(self, state: dict[str, Any], checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint saved after fit holds the replicas kept as fit ended; the module's weights may have changed
        since (``trainer.test(ckpt_path="best")`` loads others; a hook sets them). The names of those that did are
        saved beside them: a resume gives every replica z's value of each (:meth:`_take_edits_of_the_checkpoint`),
        as plain Lightning resumes from the weights the file holds."""
        kept = self._center_after_fit
        changed = [
            name
            for name, value in (checkpoint.get("state_dict") or {}).items()
            if name in kept and isinstance(value, Tensor) and not torch.equal(value.to(kept[name].device), kept[name])
        ]
        return {**state, "center_changed": changed} if changed else state

    def _keep_state_of_a_failed_fit(self) -> None:
        """A fit that ended by an error (``on_train_end`` did not run): the replicas' state is kept, as there, so that
        ``trainer.save_checkpoint`` after it saves what ``OnExceptionCheckpoint`` would have. On one process only: on
        several, the other ranks may never reach the gather it takes."""
        if self.world_size > 1:
            return
        try:
            self._keep_final_state()
        except Exception as error:  # noqa: BLE001 - the fit's own error is the one to raise, not this one
            rank_zero_warn(
                "crossbow: after the fit's error, the replicas' state could not be kept"
                f" ({type(error).__name__}: {error}); a checkpoint saved now holds the central model alone."
            )

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Moves a group of the replicas' batches batch by batch when the module (or datamodule) has its own
        ``transfer_batch_to_device`` or ``on_after_batch_transfer`` hook, so that it sees one batch at a time, as in
        plain Lightning, and in plain Lightning's order: each batch's ``on_before_batch_transfer`` (where it is the
        user's), transfer and ``on_after_batch_transfer`` before the next batch's; with Lightning's default hooks the
        group moves in one pass (batches that are tuples or lists of tensors: each tensor as Lightning's default moves
        it, without walking the group)."""
        if isinstance(batch, ReplicaGroup):
            if self._transfer_per_batch:
                module = self.lightning_module
                before = type(module)._on_before_batch_transfer if self._before_transfer_per_batch else None
                move = super(CrossbowStrategy, self).batch_to_device
                return ReplicaGroup(
                    move(b if before is None else before(module, b, dataloader_idx), device, dataloader_idx)
                    for b in batch
                )
            if tensor_sequences(batch):
                target = self.root_device if device is None else torch.device(device)
                return ReplicaGroup(moved_tensors(b, target) for b in batch)
        return super().batch_to_device(batch, device, dataloader_idx)  # the default hooks: one pass over the group

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "crossbow",
            cls,
            description="Crossbow: k replicas per device with synchronous model averaging, k tuned while training",
        )
        strategy_registry.register(
            "crossbow_spawn",
            cls,
            description="Crossbow, launching processes with torch.multiprocessing spawn, k tuned while training",
            start_method="spawn",
        )


def lr_dropped(lrs: Sequence[float], last_lrs: Sequence[float], lrs_before: Optional[Sequence[float]]) -> bool:
    """Whether a param group's learning rate fell to at most ``LR_DROP_RATIO`` of its last value, which it had
    held for a step (``lrs_before``, the values a step earlier; None: unknown, as at a fit's second step, so no
    drop). An lr held at 0 is no drop, and neither is a step of a decay that changes the lr every step."""
    if lrs_before is None:
        return False
    return any(new < old == prior and new <= LR_DROP_RATIO * old for new, old, prior in zip(lrs, last_lrs, lrs_before))


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)
