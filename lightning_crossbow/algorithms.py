r"""How the learners and the central model z are kept together around one local optimizer step.

Every learner ``w_j`` first takes one step of the user's optimizer on its own batch
(``opt_step``). Three rules then form one correction ``c_j`` per learner; the corrections of all
processes are summed (one all-reduce per flat bucket) and move z with a heavy-ball term:

.. math::

    z_{next} = z + \sum_{j=1}^{K} K p_j c_j + \mu (z - z_{prev})

with ``p_j = b_j / sum_i b_i`` learner ``j``'s share of the step's samples (Adaptive SGD's normalized
merging, in heterogeneous mode). ``K p_j = 1`` whenever every batch has the same size, the usual case
and always outside heterogeneous mode: then it is a plain sum.

- :class:`ScaledAveraging` (the default), model averaging with an outer learning rate (the outer step
  of SlowMo, Wang et al., ICLR 2020, and DiLoCo, with one local step between synchronisations):
  every learner starts the step at z, ``d_j = opt_step(w_j) - z``, ``c_j = (eta / K) d_j``, then
  ``w_j <- z_next``. With ``eta = 1, mu = 0`` this is plain averaging: the user's optimizer on the mean
  gradient of ``K`` batches, a ``K`` times larger batch at an unscaled learning rate, which needs up
  to ``K`` times the epochs. ``eta`` lengthens the averaged step only, so no learner ever takes a
  larger step on its own small batch; by default it is AdaScale's gain, measured.
- :class:`SMA`, Crossbow's synchronous model averaging (Koliousis et al., VLDB 2019):
  ``c_j = alpha (w_j - z)`` from the weights *before* the local step, ``w_j <- opt_step(w_j) - c_j``.
  Learners stay apart; each is pulled towards z by ``alpha`` per step.
- :class:`EASGD`, synchronous elastic averaging SGD (Zhang, Choromanska and LeCun, NeurIPS 2015): the
  same rule with ``mu = 0`` (Crossbow's SMA is EASGD plus momentum on the centre).

:class:`Gossip` (Jin et al., 2016) keeps no z during training: each learner averages with one peer
per step, point to point, and z is the learners' mean, formed when it is read.

The classes work on :class:`~lightning_crossbow.replicas.FlatBucket` s and reach other processes only
through the functions of :class:`StepContext`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor
from torch.optim import Adadelta, Adagrad, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop
from typing_extensions import override

from lightning_crossbow.replicas import FlatBucket
from lightning_crossbow.sma import apply_corrections_, corrections_, default_alpha, update_center_
from lightning_crossbow.validation import is_real

ALGORITHMS = ("scaled_averaging", "sma", "easgd", "gossip")
AlgorithmName = Literal["scaled_averaging", "sma", "easgd", "gossip"]
OUTER_LRS = ("adaptive", "linear")
#: Crossbow's central momentum, ``algorithm="sma"``'s default.
CROSSBOW_CENTRAL_MOMENTUM = 0.9
AllReduceSum = Callable[[Tensor], Tensor]


@dataclass
class StepContext:
    """What a rule may use at one optimizer step."""

    num_learners: int  #: K, over all processes
    step: int  #: optimizer steps taken before this one
    epochs_done: float  #: training progress once this step ends, in (fractional) epochs
    optimizer: Optimizer  #: the user's optimizer (over the stacked learners)
    all_reduce_sum: AllReduceSum  #: sums a tensor over processes, in place
    pull_rows: Callable[[Tensor, int], Tensor]  #: see :func:`lightning_crossbow.collectives.pull_rows`
    dropped: Optional[Tensor] = None  #: rows of learners whose step diverged (left out), or None
    #: ``K p_j`` per local learner, ``p_j = b_j / sum_i b_i`` its share of the step's samples over all ``K``
    #: learners (Adaptive SGD's normalized merging); None when every batch has the same size (all ``K p_j = 1``).
    learner_weights: Optional[Tensor] = None
    #: Numbers of this process (a float64 vector on the buckets' device) that the rule sums over processes *in
    #: place*, riding in its own all-reduce (:func:`all_reduce_riding`): the strategy's SIGTERM vote. None: none.
    riders: Optional[Tensor] = None
    #: Whether this is the only process: its sums are the sums over processes, and nothing is all-reduced.
    single_process: bool = False


#: Optimizers that divide by a running gradient scale: for them the square-root rule applies.
ADAPTIVE_OPTIMIZERS: tuple[type[Optimizer], ...] = (Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta)


def gain_ratio(noise: float, signal: float, num_learners: int) -> float:
    r"""AdaScale's gain (Johnson et al., ICML 2020): ``(sigma^2 + |g|^2) / (sigma^2 / K + |g|^2)``, in ``[1, K]``.

    How many times further the mean of ``K`` independent steps may go than one step: ``K`` when the
    steps are pure noise (``|g|^2 = 0``), 1 when they all agree (``sigma^2 = 0``).
    """
    signal = max(signal, 0.0)
    if noise <= 0.0:
        return 1.0
    return min(max((noise + signal) / (noise / num_learners + signal), 1.0), float(num_learners))


def noise_and_signal(mean_square: float, square_of_mean: float, num_learners: int) -> tuple[float, float]:
    r"""Unbiased ``(sigma^2, |g|^2)`` from ``K`` i.i.d. vectors ``d_j = g + noise_j``.

    With ``m = (1/K) sum_j |d_j|^2`` and ``s = |(1/K) sum_j d_j|^2``:
    ``sigma^2 = K/(K-1) (m - s)`` and ``|g|^2 = s - sigma^2 / K``.
    """
    noise = num_learners / (num_learners - 1) * (mean_square - square_of_mean)
    return noise, square_of_mean - noise / num_learners


def warmed_up(target: float, epochs_done: float, warmup_epochs: float) -> float:
    """``1 + (target - 1) min(1, epochs_done / warmup_epochs)``: linear in training progress from 1 to ``target``."""
    if warmup_epochs <= 0:
        return target
    return 1.0 + (target - 1.0) * min(1.0, epochs_done / warmup_epochs)


def local_correction_sum(
    bucket: FlatBucket, dropped: Optional[Tensor], weights: Optional[Tensor] = None, spare: int = 0
) -> Tensor:
    """``sum_j K p_j c_j`` over this process's learners (``c_j`` in ``bucket.corrections``, ``K p_j`` in
    ``weights``; 1 when None), ``dropped`` rows zeroed first. The result is a new vector with ``spare``
    unset slots at its end, where other sums may ride along in the same all-reduce."""
    if dropped is not None:
        bucket.corrections[dropped] = 0.0
    if weights is None and not spare:
        return bucket.corrections.sum(0)
    out = bucket.corrections.new_empty(bucket.corrections.shape[1] + spare)
    head = out[: bucket.corrections.shape[1]]
    if weights is None:
        torch.sum(bucket.corrections, 0, out=head)
    else:
        # (each bucket in its own dtype; matmul of a vector by a matrix would resize out=)
        torch.mv(bucket.corrections.t(), weights.to(bucket.corrections.dtype), out=head)
    return out


def riding_bucket(buckets: Sequence[FlatBucket], exact: bool, context: StepContext) -> Optional[int]:
    """The bucket whose all-reduce small sums ride in. When they must stay exact, the first float32 or float64
    one (None if every bucket is 16-bit: bfloat16 rounds integers above 256). Otherwise the first bucket: sums
    only compared with 0 (counts, votes) survive 16 bits, as non-negative numbers rounded never sum to 0. None on
    a single process (:func:`all_reduce_riding` reduces nothing there)."""
    if context.single_process:
        return None
    if not exact:
        return 0
    return next((i for i, b in enumerate(buckets) if b.corrections.dtype in (torch.float32, torch.float64)), None)


def all_reduce_riding(local: list[Tensor], riders: Tensor, rider: Optional[int], context: StepContext) -> list[Tensor]:
    """Sums every tensor of ``local`` over processes, and ``riders`` in place, in ``len(local)`` all-reduces
    (``context.all_reduce_sum``; on a single process, none: the sums are ``local`` and ``riders`` as they are).

    The riders travel in the last ``len(riders)`` slots of ``local[rider]``, which the caller left spare
    (:func:`local_correction_sum`'s ``spare``), so they add no synchronisation; with ``rider`` None they take an
    all-reduce of their own. Returns the sums without those slots.
    """
    if context.single_process:
        return local
    all_reduce_sum, n = context.all_reduce_sum, riders.numel()
    if rider is None:
        all_reduce_sum(riders)
    else:
        local[rider][-n:] = riders
    sums = [all_reduce_sum(total) for total in local]
    if rider is not None:
        riders.copy_(sums[rider][-n:])
        sums[rider] = sums[rider][:-n]
    return sums


def with_context_riders(context: StepContext, own: Tensor) -> Tensor:
    """``context.riders`` (if any) followed by a rule's ``own`` riders: the vector for :func:`all_reduce_riding`."""
    return own if context.riders is None else torch.cat([context.riders, own])


def own_riders(context: StepContext, riders: Tensor) -> Tensor:
    """After :func:`all_reduce_riding`: copies the summed ``context.riders`` back in place; returns the rule's own."""
    if context.riders is None:
        return riders
    context.riders.copy_(riders[: context.riders.numel()])
    return riders[context.riders.numel() :]


def learners_stepped(buckets: Sequence[FlatBucket], dropped: Optional[Tensor]) -> Tensor:
    """``[k - |dropped|]``: how many of this process's ``k`` learners took their step (float64, a rider)."""
    count = torch.full(
        (1,), float(buckets[0].corrections.shape[0]), dtype=torch.float64, device=buckets[0].center.device
    )
    return count if dropped is None else count.sub_(dropped.sum())


def anyone_stepped(total_stepped: Tensor, dropped: Optional[Tensor]) -> bool:
    """Whether any learner of any process took its step, given the all-reduced count ``total_stepped``. Read only
    when every learner of this process was left out (``dropped``): otherwise it is known here, without waiting
    for the all-reduce."""
    if dropped is None or not bool(dropped.all()):
        return True
    return float(total_stepped) > 0.0


class Averaging(ABC):
    """One rule. ``before_local_step`` runs after backward, while the learners hold their pre-step weights;
    ``after_local_step`` after the user's optimizer stepped every learner, and moves z. ``after_local_step`` also
    sums ``context.riders`` over processes in place, in its own all-reduce where it has one. When every learner
    of every process was left out of the step (``context.dropped``), z does not move, momentum included."""

    #: ``mu``, the momentum of z.
    central_momentum: float
    #: Whether z is not kept during training but formed, when read, as the mean of the learners.
    center_is_learner_mean = False
    #: Whether every learner starts each step at z (the strategy puts them there before the step, so a
    #: change that a callback makes to z between steps is what the next step starts from).
    learners_start_at_center = False

    def before_local_step(self, buckets: Sequence[FlatBucket], num_learners: int) -> None:
        """Nothing by default."""

    @abstractmethod
    def after_local_step(
        self,
        buckets: Sequence[FlatBucket],
        context: StepContext,
    ) -> bool:
        """Forms the corrections and moves z (or the learners); returns False when nothing moved because every
        learner of every process was left out of the step."""

    def state_dict(self) -> dict[str, Any]:
        """What the rule measured during training, for checkpoints (nothing, for most rules)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved."""


class SMA(Averaging):
    r"""Crossbow's rule: ``c_j = alpha (w_j - z)`` before the step, ``w_j <- opt_step(w_j) - c_j``.

    ``alpha = None`` means ``1/K``: with ``mu = 0`` z then moves to the mean of the pre-step learners.
    """

    def __init__(self, alpha: Optional[float] = None, central_momentum: float = 0.9) -> None:
        self.alpha = alpha
        self.central_momentum = central_momentum

    def alpha_for(self, num_learners: int) -> float:
        """The alpha in use: the one given, or ``1/K``."""
        return self.alpha if self.alpha is not None else default_alpha(num_learners)

    @override
    def before_local_step(self, buckets: Sequence[FlatBucket], num_learners: int) -> None:
        alpha = self.alpha_for(num_learners)
        for bucket in buckets:
            corrections_(bucket.corrections, bucket.replicas, bucket.center, alpha)

    @override
    def after_local_step(
        self,
        buckets: Sequence[FlatBucket],
        context: StepContext,
    ) -> bool:
        rider = riding_bucket(buckets, exact=False, context=context)
        riders = with_context_riders(context, learners_stepped(buckets, context.dropped))
        local = []
        for i, bucket in enumerate(buckets):
            spare = riders.numel() if i == rider else 0
            local.append(local_correction_sum(bucket, context.dropped, context.learner_weights, spare))
            apply_corrections_(bucket.replicas, bucket.corrections)  # (left-out rows: zeroed, so not moved)
        sums = all_reduce_riding(local, riders, rider, context)
        if not anyone_stepped(own_riders(context, riders), context.dropped):
            return False
        for bucket, correction_sum in zip(buckets, sums):
            update_center_(bucket.center, bucket.center_prev, correction_sum, self.central_momentum)
        return True


class EASGD(SMA):
    """Synchronous elastic averaging SGD: :class:`SMA` without momentum on the centre (``mu = 0``)."""

    def __init__(self, alpha: Optional[float] = None) -> None:
        super().__init__(alpha, central_momentum=0.0)


class ScaledAveraging(Averaging):
    r"""``d_j = opt_step(w_j) - z``, ``z <- z + eta_t (1/K) sum_j d_j + mu (z - z_prev)``, ``w_j <- z``.

    ``w_j <- z`` happens when the next step starts (``learners_start_at_center``): z as the step finds it,
    after whatever callbacks did to the module's parameters in between.

    ``outer_lr`` sets ``eta``:

    - ``"adaptive"`` (default): AdaScale's gain ratio (:func:`gain_ratio`), measured on the learners' own
      steps. Each step gives ``K`` independent steps ``d_j`` from the same z; their spread and their
      mean give unbiased estimates of the noise ``sigma^2`` and the signal ``|g|^2`` of one step
      (:func:`noise_and_signal`), averaged over steps with weight ``smoothing`` on the past, and
      ``eta = (sigma^2 + |g|^2) / (sigma^2 / K + |g|^2)``, in ``[1, K]``. While the small-batch steps are
      mostly noise, ``eta`` approaches ``K`` (the linear scaling rule); while they agree, 1 (plain
      averaging), where a longer step would only overshoot. Measured on steps rather than gradients,
      it covers whatever the optimizer does to a gradient (momentum, adaptive scaling). Early in
      training the steps agree, so ``eta`` starts low and rises by itself: a warm-up that is measured.
    - ``"linear"``: ``eta = K`` (``sqrt(K)`` for adaptive optimizers, the square-root rule);
    - a number: that ``eta``.

    ``eta_t`` also warms up linearly from 1 over the first ``warmup_epochs`` (:func:`warmed_up`; 0: none).

    With an optimizer whose step is linear in the gradients it has seen (SGD, with or without momentum, Nesterov or
    weight decay), every learner starting each step at z, the mean of the ``d_j`` is the step that optimizer takes
    on the mean of the learners' gradients, step after step (the mean of the momentum buffers follows the momentum
    of the mean). One step of this rule is then the user's step on one batch of all ``K`` batches' samples at
    ``eta`` times the learning rate (with ``mu = 0`` and batches of one size; up to rounding; BatchNorm statistics
    and dropout draws stay each learner's own): ``"linear"`` is the linear scaling rule, and ``"adaptive"`` that
    rule with ``eta`` measured.

    Costs beyond SMA (``"adaptive"``): one squared norm per learner, and two more numbers in the all-reduce
    of a float32 or float64 bucket's summed steps (an all-reduce of their own only when every bucket is 16-bit).

    One learner in all (``K = 1``) with ``eta = 1`` and ``mu = 0`` (the defaults give ``eta = 1`` at ``K = 1``):
    ``z_next = w_1``, copied rather than computed as ``z + (w_1 - z)`` (which rounds), and nothing else is
    computed: the user's optimizer step exactly, as in plain Lightning.
    """

    learners_start_at_center = True

    def __init__(
        self,
        outer_lr: Union[float, Literal["adaptive", "linear"]] = "adaptive",
        central_momentum: float = 0.0,
        warmup_epochs: float = 0.0,
        smoothing: float = 0.9,
    ) -> None:
        self.outer_lr = outer_lr
        self.central_momentum = central_momentum
        self.warmup_epochs = warmup_epochs
        self.smoothing = smoothing
        #: Moving averages of (sigma^2, |g|^2) for ``"adaptive"``, and how many steps they hold.
        self.noise = 0.0
        self.signal = 0.0
        self.steps_measured = 0
        #: The last outer learning rate used (logged as ``crossbow/outer_lr``).
        self.last_eta = 1.0

    def _local_statistics(self, buckets: Sequence[FlatBucket], dropped: Optional[Tensor]) -> Tensor:
        """``(sum_j |d_j|^2, learners that stepped)`` on this process, in float64 (dropped rows already zeroed);
        across processes, riding in a float32 bucket's all-reduce, they keep float32's 7 significant digits (on a
        single process, with several buckets, the sum keeps float64's)."""
        square_sum = torch.zeros(1, dtype=torch.float64, device=buckets[0].center.device)
        for bucket in buckets:
            flat = bucket.corrections.view(-1)
            square_sum += torch.dot(flat, flat)
        return torch.cat([square_sum, learners_stepped(buckets, dropped)])

    def _measure(self, statistics: Tensor, sums: Sequence[Tensor]) -> None:
        """Folds this step's ``(sigma^2, |g|^2)`` into the averages, from ``statistics`` (``sum_j |d_j|^2`` and
        ``K`` over every process) and ``sums`` (``sum_j d_j`` per bucket), read from the device in one transfer
        (on CUDA, one synchronisation a step)."""
        squares = [torch.dot(total, total).to(statistics.dtype).view(1) for total in sums]
        square_sum, learners, *bucket_squares = torch.cat([statistics, *squares]).tolist()
        if learners < 2:
            return
        square_of_mean = sum(bucket_squares) / learners**2
        noise, signal = noise_and_signal(square_sum / learners, square_of_mean, round(learners))
        beta = self.smoothing
        self.noise = beta * self.noise + (1 - beta) * noise
        self.signal = beta * self.signal + (1 - beta) * signal
        self.steps_measured += 1

    def _one_learner_takes_z(self, context: StepContext) -> bool:
        """Whether this step is one learner's own (``K = 1``, its step taken, nothing riding along) with
        ``eta = 1`` and ``mu = 0``: then ``z_next = w_1``."""
        return (
            context.num_learners == 1
            and context.dropped is None
            and context.riders is None
            and context.learner_weights is None
            and self.central_momentum == 0.0
            and (self.outer_lr in OUTER_LRS or float(self.outer_lr) == 1.0)  # (both give eta = 1 at K = 1)
        )

    def _measuring(self, context: StepContext) -> bool:
        """Whether this step measures the gain (``"adaptive"``; one learner has no spread to measure)."""
        return self.outer_lr == "adaptive" and context.num_learners > 1

    def _sum_steps(self, buckets: Sequence[FlatBucket], context: StepContext) -> tuple[list[Tensor], Tensor]:
        """``sum_j K p_j d_j`` per bucket over every process, and this rule's riders summed over every process: the
        learners that stepped (:func:`learners_stepped`), after ``sum_j |d_j|^2`` when measuring (the statistics of
        :meth:`_local_statistics`). One all-reduce per bucket: the riders go in one bucket's, with
        ``context.riders`` (:func:`all_reduce_riding`; the first float32 or float64 bucket when measuring)."""
        measuring = self._measuring(context)
        rider, local = riding_bucket(buckets, exact=measuring, context=context), []
        spare = (0 if context.riders is None else context.riders.numel()) + (2 if measuring else 1)
        for i, bucket in enumerate(buckets):
            torch.sub(bucket.replicas, bucket.center, out=bucket.corrections)  # d_j
            local.append(
                local_correction_sum(bucket, context.dropped, context.learner_weights, spare if i == rider else 0)
            )
        own = (
            self._local_statistics(buckets, context.dropped)
            if measuring
            else learners_stepped(buckets, context.dropped)
        )
        riders = with_context_riders(context, own)
        sums = all_reduce_riding(local, riders, rider, context)
        return sums, own_riders(context, riders)

    @override
    def after_local_step(
        self,
        buckets: Sequence[FlatBucket],
        context: StepContext,
    ) -> bool:
        if self._one_learner_takes_z(context):
            for bucket in buckets:
                bucket.center_prev.copy_(bucket.center)
                bucket.center.copy_(bucket.replicas[0])
            self.last_eta = 1.0
            return True
        sums, own = self._sum_steps(buckets, context)
        if not anyone_stepped(own[-1], context.dropped):
            return False
        num_learners = context.num_learners
        if self.outer_lr == "adaptive":
            if self._measuring(context):
                self._measure(own, sums)
            target = gain_ratio(self.noise, self.signal, num_learners)  # the averages' common bias cancels
        elif self.outer_lr == "linear":
            adaptive = isinstance(context.optimizer, ADAPTIVE_OPTIMIZERS)
            target = math.sqrt(num_learners) if adaptive else float(num_learners)
        else:
            target = float(self.outer_lr)
        self.last_eta = eta = warmed_up(target, context.epochs_done, self.warmup_epochs)
        for bucket, correction_sum in zip(buckets, sums):
            update_center_(
                bucket.center, bucket.center_prev, correction_sum.mul_(eta / num_learners), self.central_momentum
            )
        return True
        # (the learners move to z_next when the next step starts: learners_start_at_center)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.noise, "signal": self.signal, "steps_measured": self.steps_measured, "eta": self.last_eta}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.noise, self.signal, self.steps_measured = state["noise"], state["signal"], state["steps_measured"]
            self.last_eta = state["eta"]


class Gossip(Averaging):
    r"""Gossip averaging (Jin et al., 2016): each learner averages with one peer per step; no central model.

    .. math::

        w_i \leftarrow \tfrac{1}{2} \big(\mathrm{opt\_step}(w_i) + \mathrm{opt\_step}(w_{(i + s_t) \bmod K})\big),
        \qquad s_t = 1 + (t \bmod (K - 1))

    The peer shift ``s_t`` cycles through every other learner, so information reaches all ``K``
    learners within ``K - 1`` steps. (With ``averaging_period = H > 1``, ``t`` counts periods, ``global_step // H``:
    an epoch's last averaging, which may end a period early, takes its period's shift, and the next period's first
    averaging may take the same one.) The mixing is doubly stochastic: the learners' mean, which is z,
    moves exactly as if they were averaged, but no process waits for all others; across processes a
    step sends and receives point to point (:func:`~lightning_crossbow.collectives.pull_rows`),
    never all-reduces. Across processes z is therefore only formed (one all-reduce) at every epoch's end, at
    logging steps (for the logged spread of the learners) and when read (validation, checkpoints, test,
    predict); on one process, after every step, where it costs no collective: ``center_is_learner_mean``.
    With ``K = 1`` a learner has no peer and trains alone. A learner left out of the step (diverged, or its
    ``training_step`` skipped) takes its peer's weights, and no learner mixes in a peer whose weights are not
    finite (as a diverged step leaves them). A learner that skipped keeps its pre-step weights, finite, so its
    peer mixes them in as they are. A diverged
    learner whose peer diverged too (or that has none) restarts from the mean of this process's finite learners,
    or from z as last formed where none is (:func:`restart_stranded_`).
    """

    central_momentum = 0.0
    center_is_learner_mean = True

    @staticmethod
    def shift(step: int, num_learners: int) -> int:
        """``s_t = 1 + (t mod (K - 1))``; 0 for a single learner."""
        return 0 if num_learners < 2 else 1 + step % (num_learners - 1)

    @override
    def after_local_step(
        self,
        buckets: Sequence[FlatBucket],
        context: StepContext,
    ) -> bool:
        if context.riders is not None:  # (no all-reduce of its own to ride in)
            context.all_reduce_sum(context.riders)
        shift = self.shift(context.step, context.num_learners)
        for bucket in buckets:
            rows = bucket.replicas
            if shift:
                peers = context.pull_rows(rows, shift)
                own_ok, peer_ok = rows.isfinite().all(1, keepdim=True), peers.isfinite().all(1, keepdim=True)
                if context.dropped is not None:
                    own_ok &= ~context.dropped.unsqueeze(1)
                if bool(own_ok.all()) and bool(peer_ok.all()):
                    rows.add_(peers).mul_(0.5)
                    continue
                # a diverged learner takes its peer's weights, and nobody mixes in a diverged peer
                rows.copy_(torch.where(own_ok & peer_ok, (rows + peers) * 0.5, torch.where(own_ok, rows, peers)))
            restart_stranded_(rows, bucket.center)
        return True  # (its left-out learners take their peers' weights)


def restart_stranded_(rows: Tensor, center: Tensor) -> None:
    """Gossip's learners whose weights are still not finite (diverged, without a finite peer to take weights from;
    or alone, K=1) restart from the mean of this process's finite learners, or, where none is, from z as last
    formed (``center``: on one process after the last step; across processes at the last epoch's end, logging step
    or read)."""
    stranded = ~rows.isfinite().all(1)
    if bool(stranded.any()):
        finite = rows[~stranded]
        rows[stranded] = finite.mean(0) if len(finite) else center


def make_averaging(
    algorithm: str,
    alpha: Optional[float],
    central_momentum: Optional[float],
    outer_lr: Union[float, str],
    warmup_epochs: float,
) -> Averaging:
    """The rule named ``algorithm``, after checking that every argument given applies to it."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}.")
    if alpha is not None and not (is_real(alpha) and 0.0 < alpha <= 1.0):
        raise ValueError(f"alpha must be a number in (0, 1] or None (meaning 1/K), got {alpha!r}.")
    if central_momentum is not None and not (is_real(central_momentum) and 0.0 <= central_momentum < 1.0):
        raise ValueError(f"central_momentum must be a number in [0, 1) or None, got {central_momentum!r}.")
    if outer_lr not in OUTER_LRS and not (is_real(outer_lr) and outer_lr > 0):
        raise ValueError(f"outer_lr must be 'adaptive', 'linear' or a positive number, got {outer_lr!r}.")
    if not (is_real(warmup_epochs) and warmup_epochs >= 0):
        raise ValueError(f"warmup_epochs must be a number >= 0, got {warmup_epochs!r}.")
    # (numbers as Python floats: numpy's are accepted above)
    alpha = None if alpha is None else float(alpha)
    central_momentum = None if central_momentum is None else float(central_momentum)
    outer_lr = outer_lr if isinstance(outer_lr, str) else float(outer_lr)
    warmup_epochs = float(warmup_epochs)
    if algorithm == "scaled_averaging":
        if alpha is not None:
            raise ValueError(
                "alpha applies to algorithm='sma' and 'easgd'; scaled_averaging resets every learner to z."
            )
        return ScaledAveraging(outer_lr, central_momentum or 0.0, warmup_epochs)
    if outer_lr != "adaptive" or warmup_epochs:
        raise ValueError(f"outer_lr and warmup_epochs apply to algorithm='scaled_averaging', not {algorithm!r}.")
    if algorithm == "gossip":
        if alpha is not None or central_momentum:
            raise ValueError(
                "alpha and central_momentum do not apply to algorithm='gossip' (it keeps no central model)."
            )
        return Gossip()
    if algorithm == "easgd":
        if central_momentum:
            raise ValueError(
                f"algorithm='easgd' has no central momentum, got central_momentum={central_momentum!r}:"
                " EASGD with momentum on z is Crossbow's algorithm='sma'."
            )
        return EASGD(alpha)
    return SMA(alpha, CROSSBOW_CENTRAL_MOMENTUM if central_momentum is None else central_momentum)
