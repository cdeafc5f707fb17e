"""A thin orbax-checkpoint wrapper: train state, data-iterator state and config saved together, every N steps.

Each checkpoint holds `state` (the TrainState arrays, through `StandardSave`) and `meta` (JSON: the config, the
data-iterator state, and a SHA-256 digest of the state's bytes). The digest is what lets a restore tell a
corrupted checkpoint from a good one: orbax itself reads some damaged files back without complaint. Restoring
walks from the newest step down, reports each unreadable or corrupted checkpoint, and uses the newest good one;
a checkpoint written for a different config is refused with the differing fields named.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pathlib
import shutil
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxnn import fp8
from jaxnn._src.checks import config_differences, first_differences
from jaxnn._src.pytree import is_prng_key, path_name
from jaxnn._src.stop_signal import StopSignal  # noqa: F401 (also importable from here)
from jaxnn._src.storage import StorageError, quiet_storage_noise, storage_error
from jaxnn.errors import CheckpointError  # noqa: F401 (also importable from here)

log = logging.getLogger(__name__)


def to_saveable(tree: Any) -> Any:
    """Typed PRNG keys become their raw uint32 data (orbax stores plain arrays)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)


def from_saveable(tree: Any, like: Any) -> Any:
    """Inverse of `to_saveable`, using `like` (a tree of the original structure) to find the keys."""
    return jax.tree.map(
        lambda x, ref: jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref)) if is_prng_key(ref) else x, tree, like
    )


def _host_copy(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        # Sharded across processes (FSDP over hosts): every process gathers the whole array, so every process must
        # call this at the same point; saves, restores and the summary do.
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def state_digest(tree: Any) -> str:
    """SHA-256 over every leaf's dtype, shape and bytes, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(to_saveable(tree)):
        arr = _host_copy(leaf)
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


class Checkpointer:
    """Saves every `save_every` steps (and when forced), keeps the newest `keep`, restores the newest good one.

    `ignore` names config fields allowed to differ on restore (paths, logging cadence, device count).
    `async_save`: orbax writes in background threads while training goes on (the default), or `save` returns
    only once the checkpoint is on disk. `keep_best="accuracy"` (with `best_mode` "max" or "min") keeps the
    `keep` checkpoints whose saved metrics are best (orbax's `best_fn`), plus every one saved without metrics.
    `read_only`: only restores; the directory is neither created nor cleaned of half-written steps (they may be
    another live run's saves in progress).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        save_every: int = 0,
        ignore: Iterable[str] = (),
        async_save: bool = True,
        keep_best: str | None = None,
        best_mode: str = "min",
        read_only: bool = False,
    ):
        import orbax.checkpoint as ocp

        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.save_every = save_every
        self.ignore = tuple(ignore)
        self._ocp = ocp
        self.keep_best = keep_best
        best = {"best_fn": lambda metrics: metrics[keep_best], "best_mode": best_mode} if keep_best else {}
        quiet_storage_noise()  # before the manager, which reads every step's metadata
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=not read_only,
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
                enable_async_checkpointing=async_save,
                **best,
            ),
        )
        self._in_flight: int | None = None
        self._closed = False
        self._bad: set[int] = set()  # steps a restore found damaged: a later save at that step replaces them

    def all_steps(self) -> list[int]:
        """Every step with a checkpoint in the directory, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or None when the directory holds none."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `step` is one `save_every` asks for (never when `save_every` is 0)."""
        return self.save_every > 0 and step % self.save_every == 0

    def save(
        self, step: int, state: Any, *, data_state: dict, config: dict, force: bool = False, metrics: dict | None = None
    ) -> bool:
        """Saves at `step` when it is a multiple of `save_every` or `force`d; returns whether it saved.

        `metrics` (e.g. the evaluation at `step`) rank the checkpoint under `keep_best`; without them it is kept.
        """
        if not (force or self.should_save(step)):
            return False
        if step in self._bad:
            self._manager.delete(step)
            self._bad.discard(step)
        elif step in self._manager.all_steps():
            return False
        self.wait()
        self._check_space(step, state)
        ocp = self._ocp
        meta = {
            "step": int(step),
            "config": config,
            "data": data_state,
            "digest": state_digest(state),
            "digests": _part_digests(state),
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(to_saveable(state)), meta=ocp.args.JsonSave(meta))
        # orbax writes in the background: the previous save was waited for above, so that its errors are
        # reported against its own step (orbax's save would wait for it anyway).
        with self._storage_errors(step):
            self._manager.save(step, args=args, force=True, metrics=metrics if self.keep_best else None)
        self._in_flight = step
        return True

    def _check_space(self, step: int, state: Any) -> None:
        """Refuses a save the disk cannot hold, before writing: a save that runs out of space half-way leaves
        orbax's background threads to print pages of tracebacks."""
        needed = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(state))
        needed = int(needed * 1.1) + (1 << 20)  # orbax's metadata and the OCDBT index
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise StorageError(
                errno.ENOSPC,
                f"saving checkpoint step {step} to {self.directory} needs about {needed / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB free: No space left on device; free some space, then resume",
            )

    @contextlib.contextmanager
    def _storage_errors(self, step: int):
        """OS errors (disk full, permissions) while saving become one StorageError line; no partial step is left."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - orbax and tensorstore wrap OS errors in many types
            self._in_flight = None
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
            raise storage_error(f"saving checkpoint step {step} to", self.directory, err) from err

    def wait(self) -> None:
        """Waits for the save in flight; its failure raises StorageError naming its step."""
        if self._in_flight is None:
            self._manager.wait_until_finished()
            return
        with self._storage_errors(self._in_flight):
            self._manager.wait_until_finished()
        self._in_flight = None

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's threads; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()

    def read_meta(self, step: int) -> dict:
        """The JSON saved beside step `step`'s state: the run's config, the data position, the digests."""
        ocp = self._ocp
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def check_compatible(self, step: int, meta: dict, config: dict) -> None:
        """Refuses (`CheckpointError`, naming each difference) a checkpoint whose config differs from `config`
        in a field other than those in `ignore`."""
        diffs = config_differences(meta.get("config", {}), config, self.ignore)
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is from a different config: " + "; ".join(diffs)
            )

    def _check_layout(self, step: int, target) -> None:
        """Refuses a target of another structure than the saved state, without calling the checkpoint damaged.

        orbax reports such a mismatch as a read error; asked for the wrong thing (e.g. a state built with another
        optimizer), a good checkpoint must stay good, and must never be deleted as damaged.
        """
        from etils import epath

        try:
            metadata = self._ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory / str(step) / "state"))
            saved_tree = getattr(metadata, "tree", metadata)
        except Exception:  # noqa: BLE001 - unreadable metadata: the restore that follows reports the damage
            return
        is_array = lambda x: hasattr(x, "name") and hasattr(x, "shape")  # noqa: E731
        saved = {x.name: tuple(x.shape) for x in jax.tree.leaves(saved_tree, is_leaf=is_array) if is_array(x)}
        wanted = {_dotted(path): tuple(x.shape) for path, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        diffs = config_differences(saved, wanted, saved_as="saved", now_as="asked for")
        if saved and diffs:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds a state of another structure than "
                f"the one to restore into ({len(diffs)} arrays differ: {first_differences(diffs)}); build the "
                "state with the model and optimizer it was saved with"
            )

    def restore(self, like_state: Any, config: dict | None) -> tuple[Any, dict, int] | None:
        """The newest good checkpoint as `(state, data_state, step)`, or None when the directory has none.

        `like_state` is a state of the right structure, shapes, dtypes and shardings (e.g. freshly initialised).
        Raises CheckpointError for an incompatible config (`config` None: any config, as when another run's
        state starts a new one), or when every checkpoint present is unreadable.
        """
        ocp = self._ocp
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return None
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), to_saveable(like_state)
        )
        problems = []
        for step in steps:
            where = self.directory / str(step)
            try:
                meta = self.read_meta(step)
            except Exception as err:  # noqa: BLE001 - orbax raises many types for damaged files
                self._bad.add(step)
                problems.append(f"step {step}: unreadable metadata ({type(err).__name__}: {str(err)[:200]})")
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", where, problems[-1])
                continue
            if config is not None:
                self.check_compatible(step, meta, config)
            self._check_layout(step, target)
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
                state = from_saveable(restored["state"], like_state)
            except Exception as err:  # noqa: BLE001
                self._bad.add(step)
                problems.append(f"step {step}: unreadable state ({type(err).__name__}: {str(err)[:200]})")
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", where, problems[-1])
                continue
            if state_digest(state) != meta.get("digest"):
                self._bad.add(step)
                problems.append(f"step {step}: state bytes do not match the saved digest (corrupted)")
                log.warning(
                    "checkpoint %s is corrupted (its state does not match its digest); trying the previous one", where
                )
                continue
            if problems:
                log.warning("restored checkpoint %s after skipping: %s", where, "; ".join(problems))
            return state, meta.get("data", {}), step
        raise CheckpointError(f"{self.directory}: no readable checkpoint ({'; '.join(problems)})")


def _dotted(path: Any) -> str:
    """A pytree path as orbax names the array it saves for it (`opt_state.1.0.mu.1_dense.w`)."""
    return path_name(path)


# The parts of a train state that `load_params` reads back alone, each with its own digest.
REUSABLE_PARTS = ("params", "model_state")


def _part_digests(state: Any) -> dict[str, str]:
    return {part: state_digest(getattr(state, part)) for part in REUSABLE_PARTS if hasattr(state, part)}


class LoadedParams(NamedTuple):
    params: Any  # nested dicts of jax arrays, as the model's init made them
    model_state: Any  # e.g. BatchNorm statistics; {} when the model has none
    step: int
    config: dict  # the run's config as saved with the checkpoint (model config included)
    directory: pathlib.Path


def checkpoint_dir(path: str | os.PathLike[str]) -> pathlib.Path:
    """The checkpoint directory for a run directory (its `ckpt/`), a checkpoint directory, or one step folder."""
    path = pathlib.Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a run or checkpoint directory")
    if (path / "ckpt").is_dir():
        return path / "ckpt"
    return path.parent if path.name.isdigit() and (path / "state").is_dir() else path


def load_train_state(path: str | os.PathLike[str], like_state: Any) -> tuple[Any, int]:
    """The whole train state (params, model state, optimizer state, ...) of the newest good checkpoint under
    `path` (a run directory, its checkpoint directory or one step's folder), into the structure and shardings
    of `like_state`, whatever config the run had; and its step. A state of another structure is refused.
    (A step folder names its checkpoint directory: the newest good step there is used.)"""
    directory = checkpoint_dir(path)
    ckpt = Checkpointer(directory, keep=1, read_only=True)
    try:
        restored = ckpt.restore(like_state, None)
    finally:
        ckpt.close()
    if restored is None:
        raise CheckpointError(f"{directory}: holds no checkpoint")
    return restored[0], restored[2]


def load_params(path: str | os.PathLike[str], *, step: int | None = None) -> LoadedParams:
    """The parameters and model state of a jaxnn checkpoint, without its optimizer state, config or a template (nor
    the fp8 amax histories a delayed-scaling run trains with).

    `path` is a run directory, its checkpoint directory or one step's folder; without `step` (or a step folder)
    the newest checkpoint whose parameters read back and match their saved digest is used; damaged ones are
    reported and skipped, never changed. Arrays come back on the first local device.
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path)
    directory = checkpoint_dir(path)
    if step is None and path.name.isdigit() and (path / "state").is_dir():
        step = int(path.name)
    saved = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    if not saved:
        raise CheckpointError(f"{directory}: holds no checkpoint")
    if step is not None and step not in saved:
        raise CheckpointError(
            f"{directory}: no checkpoint at step {step}; it has steps {', '.join(map(str, sorted(saved)))}"
        )
    steps = [step] if step is not None else saved
    problems = []
    quiet_storage_noise()
    with ocp.CheckpointManager(directory.absolute()) as manager:
        for s in steps:
            try:
                return _load_parts(manager, directory, s)
            except Exception as err:  # noqa: BLE001 - damaged files raise many types; the next step may be good
                problems.append(f"step {s}: {type(err).__name__}: {str(err).strip().splitlines()[0][:200]}")
                log.warning("checkpoint %s: %s; trying the previous one", directory / str(s), problems[-1])
    raise CheckpointError(f"{directory}: no readable parameters ({'; '.join(problems)})")


def _load_parts(manager: Any, directory: pathlib.Path, step: int) -> LoadedParams:
    import orbax.checkpoint as ocp
    from etils import epath

    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(directory.absolute() / str(step) / "state"))
    saved = getattr(saved, "tree", saved)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    target = {
        part: jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved[part], is_leaf=is_array
        )
        for part in REUSABLE_PARTS
        if part in saved
    }
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        ),
    )["state"]
    parts = {part: restored.get(part, {}) for part in REUSABLE_PARTS}
    for part, digest in meta.get("digests", {}).items():
        if part in parts and state_digest(parts[part]) != digest:
            raise CheckpointError(f"its {part} do not match their saved digest (corrupted)")
    # A delayed-scaling fp8 run's amax histories are training state: the model's parameters go without them.
    params = fp8.without_histories(parts["params"])
    return LoadedParams(params, parts["model_state"], step, meta.get("config", {}), directory)
