"""lightning-crossbow: Crossbow's k replicas per device and synchronous model averaging for Lightning.

``import lightning_crossbow`` registers the strategy names ``"crossbow"`` and ``"crossbow_spawn"`` and
the accelerator name ``"crossbow"``, so ``Trainer(strategy="crossbow")`` works.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_crossbow.accelerator import CrossbowAccelerator
from lightning_crossbow.balancing import SpeedBalancer, StepTime
from lightning_crossbow.strategy import CrossbowStrategy
from lightning_crossbow.tuner import ReplicaAutoTuner, TuningRecord

__all__ = ["CrossbowAccelerator", "CrossbowStrategy", "ReplicaAutoTuner", "SpeedBalancer", "StepTime", "TuningRecord"]
__version__ = "0.1.0"

if "crossbow" not in StrategyRegistry:
    CrossbowStrategy.register_strategies(StrategyRegistry)
if "crossbow" not in AcceleratorRegistry:
    CrossbowAccelerator.register_accelerators(AcceleratorRegistry)
