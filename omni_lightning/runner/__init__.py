from omni_lightning.runner.loop import OmniPredictionLoop
from omni_lightning.runner.output import OmniModelRunnerOutput, build_pooler_output
from omni_lightning.runner.trainer import Trainer

__all__ = ["OmniModelRunnerOutput", "OmniPredictionLoop", "Trainer", "build_pooler_output"]
