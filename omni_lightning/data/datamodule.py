"""``CodesDataModule``: datasets, length-bucketed loaders and the collate function in one place."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from omni_lightning.data.collate import collate_codes
from omni_lightning.data.dataset import BAD_INPUT_MODES, CodesDataset
from omni_lightning.data.output_folder import Finished, PredictPlan
from omni_lightning.data.sampler import LengthBucketBatchSampler
from omni_lightning.data.sources import DUPLICATE_ID_MODES
from omni_lightning.errors import UsageError, check_count
from omni_lightning.models import Code2WavConfig
from omni_lightning.models.config import PRESETS

Source = str | Path | list


class CodesDataModule(pl.LightningDataModule):
    """Codes, and for training and evaluation their audio, from files or memory in length-bucketed batches.

    A source is a folder of code files, a JSONL manifest, or data in memory: a list (ids ``"0"``,
    ``"1"``, ...) or dict (id -> value) of codes ``[Q, T]``, or for fit, validate and test of
    ``(codes, audio)`` pairs, audio float ``[n]`` or ``[1, n]`` at the model's sample rate
    (``config.sample_rate``, 24 kHz for the shipped presets; see ``CodesDataset``). ``predict`` may
    also be a list of sources (paths, dicts or ``CodesDataset`` objects), one dataloader each. The codebook
    geometry comes from ``config`` or from the trainer's module. Batches come from ``collate_codes``
    with its "checked" mark, so the module does not check their codes again; on CUDA they are
    collated into pinned memory. ``predict_plan`` records the predict job in ``setup`` (every id, input
    files not read, what was finished), which a writer reads before anything is decoded.

    Args:
        predict: what to decode: a folder, a JSONL manifest, codes in memory, or a list of such sources
            (codes only: audio that a manifest or a pair holds is neither checked nor read).
        train: fit's paired data: a JSONL manifest with audio paths, or (codes, audio) pairs in memory.
        val: validation's paired data; a fit without it runs no validation.
        test: test's paired data.
        batch_size: requests per batch at most.
        max_frames: padded frames per batch at most (requests x longest); None: no limit.
        num_workers: loader processes; None: 0 for data in memory, else Lightning's suggestion for this
            machine (0 when it suggests one or fewer, at most 4).
        on_bad_input: "skip" decodes the good requests and reports the bad ones; "raise" stops before any compute.
        crop_frames: training crops of that many frames (and their audio); None: whole requests.
        config: preset name whose codebook geometry the codes are checked against; None: the module's.
        seed: seeds the training batches' order and the crops.
        duplicate_ids: "error" refuses a source whose ids repeat; "rename" numbers the repeats (a, a#2, ...).
        skip_done: an output folder (or its read ``Finished``): the requests its manifest lists as finished
            are neither read nor decoded, so a rerun resumes (the command line sets it to --out_dir).
    """

    def __init__(
        self,
        predict: Source | None = None,
        train: Source | None = None,
        val: Source | None = None,
        test: Source | None = None,
        batch_size: int = 8,
        max_frames: int | None = None,
        num_workers: int | None = None,
        on_bad_input: str = "skip",
        crop_frames: int | None = None,
        config: str | None = None,
        seed: int = 0,
        duplicate_ids: str = "error",
        skip_done: str | Path | Finished | None = None,
    ) -> None:
        super().__init__()
        # checked here, where a mistake is the caller's, not inside a dataloader hook: Lightning 2.6
        # leaves DataLoader.__init__ patched when a hook raises
        check_count("batch_size", batch_size)
        check_count("max_frames", max_frames, none_ok=True)
        check_count("num_workers", num_workers, minimum=0, none_ok=True)  # None: chosen for this machine
        check_count("seed", seed, minimum=0)
        if on_bad_input not in BAD_INPUT_MODES:
            raise UsageError(f"on_bad_input must be one of {BAD_INPUT_MODES}, got {on_bad_input!r}")
        if duplicate_ids not in DUPLICATE_ID_MODES:
            raise UsageError(f"duplicate_ids must be one of {DUPLICATE_ID_MODES}, got {duplicate_ids!r}")
        if isinstance(config, str) and config not in PRESETS:  # else a ValueError deep inside setup
            raise UsageError(
                f"config {config!r} is not a preset: use one of {', '.join(sorted(PRESETS))}, or None (the module's)"
            )
        self.sources = {"predict": predict, "fit": train, "validate": val, "test": test}
        self.batch_size = batch_size
        self.max_frames = max_frames
        self.num_workers = num_workers
        self.on_bad_input = on_bad_input
        self.crop_frames = crop_frames
        self.config = config
        self.seed = seed
        self.duplicate_ids = duplicate_ids
        self.skip_done = skip_done
        self.datasets: dict[str, Any] = {}
        self.predict_plan: PredictPlan | None = None
        # under DDP a rank may be dealt no request (fewer than ranks): it still joins the job's start and end
        self.allow_zero_length_dataloader_with_multiple_devices = True

    def _config(self) -> Code2WavConfig | str:
        if self.config is not None:
            return self.config
        module = self.trainer.lightning_module if self.trainer is not None else None
        return module.config if module is not None and hasattr(module, "config") else "qwen3-omni"

    def _dataset(
        self, source: Any, train: bool = False, skip: Collection[str] = (), paired: bool = True
    ) -> CodesDataset:
        """``paired=False`` (predict): codes only, a manifest's audio paths neither checked nor read."""
        if isinstance(source, CodesDataset):
            return source
        crop = self.crop_frames if train else None
        return CodesDataset(
            source,
            self._config(),
            on_bad_input=self.on_bad_input,
            load_audio=paired,
            crop_frames=crop,
            seed=self.seed,
            duplicate_ids=self.duplicate_ids,
            skip=skip,
            paired=paired,
        )

    def setup(self, stage: str) -> None:
        # refused here rather than in the dataloader hook: Lightning 2.6 leaves DataLoader.__init__
        # patched when that hook raises, which breaks every DataLoader made later in the process
        name = str(getattr(stage, "value", stage))
        if self.sources.get(name, "") is None and name not in self.datasets:
            raise UsageError(f"CodesDataModule has no {name!r} data: pass {_ARGUMENT[name]}=... to its constructor")
        if stage == "predict" and self.sources["predict"] is not None:
            self._setup_predict(self.sources["predict"])
        if stage == "fit" and self.sources["fit"] is not None:
            self.datasets["fit"] = self._dataset(self.sources["fit"], train=True)
        if stage in ("fit", "validate") and self.sources["validate"] is not None:
            self.datasets["validate"] = self._dataset(self.sources["validate"])
        if stage == "test" and self.sources["test"] is not None:
            self.datasets["test"] = self._dataset(self.sources["test"])
        for key in {"fit": ("fit", "validate"), "validate": ("validate",), "test": ("test",)}.get(name, ()):
            bad = self.datasets[key].bad if key in self.datasets else {}
            if bad and len(bad) == len(self.datasets[key]):  # nothing to train or evaluate on: not a run
                req_id, reason = next(iter(bad.items()))
                raise UsageError(f"all {len(bad)} {_ARGUMENT[key]} request(s) are bad, e.g. {req_id}: {reason}")
        self._check_ranks(stage)

    def _check_ranks(self, stage: str) -> None:
        """Under DDP, fewer requests than ranks: Lightning's evaluation loop skips a rank with no batch
        (whose metrics then never meet the others'), and Lightning's own predict sampler refuses one."""
        world = self.trainer.world_size if self.trainer is not None else 1
        stage = str(getattr(stage, "value", stage))  # Lightning passes its TrainerFn
        if world == 1 or stage not in ("fit", "validate", "test", "predict"):
            return
        if stage == "predict":
            fix = (
                "pass Trainer(use_distributed_sampler=False): this data module splits the requests across "
                "ranks itself (the command line does so)"
            )
            datasets = self.datasets.get("predict", []) if _injects_sampler(self.trainer) else []
        else:
            fix, name = "use fewer devices", "test" if stage == "test" else "validate"
            datasets = [self.datasets[name]] if name in self.datasets else []
        for ds in datasets:
            if 0 < len(ds) < world:
                raise UsageError(f"{len(ds)} {stage} request(s) for {world} ranks, so a rank would have none: {fix}")

    def _setup_predict(self, sources: Any) -> None:
        # a list of paths, mappings or datasets is several sources; a list of tensors is one source
        many = (
            isinstance(sources, (list, tuple))
            and len(sources) > 0
            and all(isinstance(s, (str, Path, Mapping, CodesDataset)) for s in sources)
        )
        finished = self.skip_done
        if isinstance(finished, (str, Path)):
            finished = Finished.read(finished)
        skip = finished.ids if finished is not None else set()
        datasets = [self._dataset(s, skip=skip, paired=False) for s in (sources if many else [sources])]
        self.datasets["predict"] = datasets
        ids = [i for ds in datasets for i in (*ds.skipped, *ds.ids)]
        self.predict_plan = PredictPlan(finished, ids, [p for ds in datasets for p in ds.unread])

    def _workers(self, dataset: CodesDataset) -> int:
        if self.num_workers is not None:
            return self.num_workers
        if not dataset.reads_files:
            return 0
        from lightning.fabric.utilities.data import suggested_max_num_workers

        devices = self.trainer.num_devices if self.trainer is not None else 1
        suggested = suggested_max_num_workers(devices)
        return 0 if suggested <= 1 else min(suggested, 4)

    def _loader(self, dataset: CodesDataset, shuffle: bool = False) -> DataLoader:
        sampler = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        # training steps in lockstep under DDP (even batches); inference takes each request once
        batches = LengthBucketBatchSampler(
            sampler,
            self.batch_size,
            lengths=dataset.lengths,
            max_frames=self.max_frames,
            shuffle=shuffle,
            seed=self.seed,
            even_batches=shuffle,
            num_replicas=world,
            rank=rank,
        )
        pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        loader = (StartsAtFirstBatch if shuffle else DataLoader)(
            dataset, batch_sampler=batches, collate_fn=collate_codes, num_workers=self._workers(dataset), pin_memory=pin
        )
        if shuffle and self.trainer is not None:
            loader.finished_batches = lambda: self.trainer.fit_loop.epoch_loop.batch_progress.current.completed
        return loader

    def _require(self, stage: str) -> Any:
        if stage not in self.datasets:  # setup refuses a stage without data; this is a hook called without it
            raise UsageError(f"CodesDataModule has no {stage!r} data: pass {_ARGUMENT[stage]}=... to its constructor")
        return self.datasets[stage]

    def predict_dataloader(self) -> list[DataLoader]:
        loaders = [self._loader(ds) for ds in self._require("predict")]
        if self.predict_plan is not None and not self.predict_plan.pending:
            # every request finished in skip_done (a rerun): the writer's summary says so; Lightning's
            # warning that the loaders are empty ("make sure this was your intention") is not for the user
            warnings.filterwarnings("ignore", message=r"Total length of `DataLoader` across ranks is zero\.")
        return loaders

    def train_dataloader(self) -> DataLoader:
        dataset = self._require("fit")
        # crops keyed on the epoch even for a loader iterated outside a fit (Lightning sets it each epoch)
        dataset.set_epoch(self.trainer.current_epoch if self.trainer is not None else 0)
        return self._loader(dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        fitting = self.trainer is not None and self.trainer.state.fn == "fit"  # TrainerFn is a str enum
        if fitting and "validate" not in self.datasets:
            return []  # a fit with training data only: Lightning runs no validation
        return self._loader(self._require("validate"))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._require("test"))


class StartsAtFirstBatch(DataLoader):
    """The training loader: iterating it starts its workers and its batch sampler at the first batch.

    Lightning makes a fit's first iterator before it sets the samplers' epoch; a plain loader would start
    its workers there, with the epoch it was built with, so a fit resumed from a checkpoint would take
    other crops and another batch order than an uninterrupted one. Deferred here, the epoch is set before
    anything reads it. Resumable (Lightning's ``state_dict`` / ``load_state_dict``): a fit resumed within
    an epoch goes on after the batches it finished there (``finished_batches``: the fit loop's count).
    """

    finished_batches: Callable[[], int] | None = None
    _resumed = False

    def state_dict(self) -> dict[str, Any]:
        return {}  # the place is the fit loop's own count

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = True

    def __iter__(self) -> Iterator[Any]:
        return _Deferred(self._start)

    def _start(self) -> Iterator[Any]:
        if self._resumed and self.finished_batches is not None and hasattr(self.batch_sampler, "start_after"):
            self.batch_sampler.start_after(self.finished_batches())
        self._resumed = False
        return super().__iter__()


class _Deferred:
    """An iterator made by ``start`` on the first ``next``."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start: Callable[[], Iterator[Any]] | None = start
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _Deferred:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            assert self._start is not None
            self._iterator, self._start = self._start(), None
        return next(self._iterator)


_ARGUMENT = {"predict": "predict", "fit": "train", "validate": "val", "test": "test"}  # stage -> constructor argument


def _injects_sampler(trainer: Any) -> bool:
    """Whether Lightning wraps loaders in its DistributedSampler (``Trainer(use_distributed_sampler=...)``,
    which Lightning keeps on a private attribute only; tests/test_contract.py checks it is there)."""
    return bool(getattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", True))
