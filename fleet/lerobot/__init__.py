"""LeRobot v3 dataset interop: export episodes of our store as a LeRobot dataset, import one into it.

LeRobot (0.6.1, dataset format ``v3.0``) is what most open robot-learning code trains on, so our episodes
should leave in its format and its datasets (teleoperated demos, DAgger recordings, eval rollouts) should
come into our store. Both directions go through LeRobot's own ``LeRobotDataset`` (``create`` /
``add_frame`` / ``save_episode`` / ``finalize`` to write, ``LeRobotDataset(repo_id, root=...)`` to read), so
what we write is what LeRobot itself reads and vice versa; everything happens on local disk.

Column mapping (ours -> LeRobot):

=====================================  =========================================================
``state`` float32 [S]                  ``observation.state`` (names = ``spec.state_names``)
``action`` float32 [A]                 ``action`` (names = ``spec.action_names``)
``cameras[c]`` uint8 [H, W, 3]         ``observation.images.<c>`` ("video", the default as in
                                       LeRobot: lossy AV1 mp4; "image" with ``use_videos=False``:
                                       lossless PNG inside the parquet)
``reward``                             ``next.reward`` float32
``terminated | truncated``             ``next.done`` bool: the episode ended at this frame (the
                                       meaning ``lerobot_eval`` gives it); always True on each
                                       episode's last frame
``truncated``                          ``next.truncated`` bool (so terminated = done & ~truncated); a
                                       last frame that is neither is exported as truncated
episode success (known outcomes)       ``next.success`` bool, True on the last frame of a success
outcome known                          ``outcome_known`` bool, False on every frame of an episode
                                       whose outcome is ``"unknown"`` (see below)
``controller``                         ``controller`` int64 (policy=0, human=1, scripted=2)
frame in an ``intervention`` segment   ``intervention`` bool, the column LeRobot's DAgger rollout
                                       strategy records: a human took over this frame
``segment``                            ``segment`` int64, index into the episode's segments
instruction                            the per-frame ``task`` string
``spec.control_hz``                    ``fps`` (LeRobot stores an integer)
=====================================  =========================================================

Unknown outcomes stay unknown. LeRobot has no null for a bool feature (``add_frame`` wants a bool
array on every frame, and its torch readers cannot batch nulls), so: when no exported episode has a
known outcome, ``next.success`` and ``outcome_known`` are left out altogether (a dataset without
``next.success`` is what ``lerobot-record`` writes: success unknown); otherwise ``next.success`` is
False on the frames of unknown-outcome episodes and ``outcome_known`` says they are not failures, and
the sidecar has ``"outcome": "unknown", "success": null`` for them. A reader's rule: episode e
succeeded iff ``any(next.success)``, failed iff not and ``all(outcome_known)``, else unknown.
:func:`import_lerobot` applies that rule, so import(export(x)) keeps unknown outcomes unknown.

Intervention is one thing in three places, by construction: a frame is under intervention iff it is
in a segment of kind ``intervention``. ``vla-rl store info`` counts those frames (intervention rate),
the export's ``intervention`` column is that per frame, and the import makes every frame a human
drives (``intervention`` / HIL-SERL flag True, ``controller`` 1, or no such column and the default
controller human) an ``intervention`` segment with controller human, and every other frame an
``autonomous`` one.

What LeRobot cannot hold per frame (segment kinds and reasons, outcomes, episode ids, the full robot
spec) goes into a sidecar, ``meta/vla_rl.json``. LeRobot ignores files it does not know, and
:func:`import_lerobot` uses the sidecar only where it still agrees with the data, so an export imported
back reproduces episodes exactly: frames bit for bit (images too, unless stored as video), segments,
outcomes and spec. Not carried: ``proposed_action``, ``uncertainty`` (an import has none: all NaN),
checkpoint ``revision`` and per-frame wall-clock ``timestamp`` (LeRobot timestamps are
``frame_index / fps``; an import restores each episode's start time from the sidecar, or uses the
import time, and spaces frames at ``1 / fps``).

LeRobot is imported lazily: it pulls in torch and takes seconds, and most users of :mod:`fleet` never
need it. LeRobot resolves ``HF_HOME`` / ``HF_LEROBOT_HOME`` when it is first imported, and reading a
dataset converts its parquet files to an Arrow cache under ``HF_HOME`` (``datasets``).

The package, by job: :mod:`fleet.lerobot.schema` (the feature keys and the sidecar's place, both
directions), :mod:`fleet.lerobot.exporter` (:func:`export_lerobot`), :mod:`fleet.lerobot.labels` (the
labels an export carries), and the import: :mod:`fleet.lerobot.source` (the dataset's files, features
and sidecar), :mod:`fleet.lerobot.plan` (every episode read and checked), :mod:`fleet.lerobot.images`
(its camera frames), :mod:`fleet.lerobot.importer` (:func:`import_lerobot`). Import from here:
``from fleet.lerobot import export_lerobot, import_lerobot``.
"""

from fleet.lerobot.exporter import MIN_VIDEO_SIDE, export_lerobot, intervention_frames
from fleet.lerobot.importer import DuplicateImportError, dataset_fingerprint, import_lerobot
from fleet.lerobot.labels import LABEL_COLUMNS, LABELS_PATH, read_exported_labels
from fleet.lerobot.schema import SIDECAR_PATH

__all__ = [
    "LABELS_PATH",
    "LABEL_COLUMNS",
    "MIN_VIDEO_SIDE",
    "SIDECAR_PATH",
    "DuplicateImportError",
    "dataset_fingerprint",
    "export_lerobot",
    "import_lerobot",
    "intervention_frames",
    "read_exported_labels",
]
