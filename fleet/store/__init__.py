"""Append-only Zarr v3 episode store.

Layout::

    <root>/zarr.json                      root group (attrs mark it as an episode store)
    <root>/episodes/zarr.json             plain group, so ``zarr.open_group(root)`` reaches every episode
    <root>/episodes/<episode_id>/         one zarr group per episode
        zarr.json                         group attrs: the episode's creation metadata (informational)
        commit.json                       the commit record: committed length + all metadata (authoritative)
        cameras/<name>                    uint8   [T, H, W, 3]
        state, action, proposed_action    float32 [T, S] / [T, A] / [T, A] (all-NaN row = no proposal)
        reward                            float32 [T]
        terminated, truncated             bool    [T]
        controller                        uint8   [T]  (:class:`Controller`)
        segment                           int32   [T]  (index into the segments list)
        revision                          int16   [T]  (index into the revisions table)
        timestamp                         float64 [T]  (unix seconds)
        uncertainty                       float32 [T]  (the policy's per-chunk score, NaN = none; optional)
        failure                           float32 [T]  (the failure predictor's per-chunk score in [0, 1],
                                                        NaN = none; optional)

``uncertainty`` and ``failure`` are *optional*: episodes recorded before they existed have no such
array, pass ``verify`` without it, and, resumed by a newer writer, stay without it (their scores are
dropped, not back-filled). A missing ``uncertainty`` reads as None (:attr:`Episode.uncertainty`), a
missing ``failure`` as all NaN (:attr:`Episode.failure`). Every episode created now has both (all NaN
when nothing was scored).

One group per episode means concurrent writers of *different* episodes, even in different processes,
never touch the same array (two processes appending to one zarr array corrupt it).

Commit protocol. A writer buffers validated frames in memory and writes them in chunk-aligned blocks
(one-frame appends rewrite the whole chunk and are much slower: docs/store.md, Episode store). After a
block's data is in every array, the writer replaces ``commit.json`` atomically (temp file + optional
fsync + ``os.replace``) with the new committed length. Arrays may be longer than that: the writer grows
them ahead of the data, and a writer killed between writing data and committing leaves rows nobody
committed. Readers trust only ``commit.json``'s length, so such rows are never returned.

Why a separate file rather than zarr attributes: zarr 3.4's ``LocalStore`` does write each key through
a temp file and ``os.replace``, so ``zarr.json`` is atomic against a killed process, but it never
fsyncs and a killed write leaves ``*.partial`` files behind; a dedicated commit file lets us order
data before commit explicitly, fsync both when asked, and snapshot length, segments and revisions
together in one atomic write.

The package, by job: :mod:`fleet.store.layout` (constants, :class:`Episode`, what every part shares),
:mod:`fleet.store.writer` (:class:`EpisodeWriter`), :mod:`fleet.store.store` (:class:`EpisodeStore`),
:mod:`fleet.store.verify` (``EpisodeStore.verify``).
"""

from fleet.store.layout import Episode, outcome_known
from fleet.store.store import EpisodeStore
from fleet.store.writer import EpisodeWriter

__all__ = ["Episode", "EpisodeStore", "EpisodeWriter", "outcome_known"]
