"""Fleet collector: many robots stream frames, segments and outcomes into one episode store, exactly once.

Wire contract: ``packages/vla-rl-client/vla_rl_client/proto/collector.proto``. A robot opens a stream, says who it is (``Hello``: robot
id, task, robot spec), then sends episodes: ``StartEpisode``, ``SegmentMarker`` (who is in control from
which frame, and why), ``FrameBatch`` (consecutive frames with the index of the first, ``seq``) and
``EndEpisode`` (outcome). Every message is answered in order with an ``Ack`` (what is durable for that
episode) or a ``Reject`` (nothing of it was stored; the message names the field).

How "exactly once" and "ack only when durable" are kept, cheaply:

* **Write-ahead log, then Zarr.** An accepted message is appended to the episode's log
  (``<store>/wal/<episode_id>.wal``, see ``fleet/wal.py``: length + CRC32 + the message bytes; fsynced
  first with ``fsync=True``) and acknowledged. A store writer process (``fleet/store_writer.py``;
  ``store_writers``, default 1) then reads the log back and feeds the frames to the episode's
  :class:`~fleet.store.EpisodeWriter`, which writes chunk-aligned blocks and commits them in
  ``commit.json``. The collector tells it only "the log of E is written up to byte B"; frame data never
  crosses a pipe. Committing every small batch straight into Zarr would read, decompress, recompress
  and rewrite each of the 12 arrays' partial chunks per commit, far too much CPU for 16 robots at 30 Hz
  with acks under 100 ms on two cores. And the Zarr writes run beside the intake, not under its GIL: in
  one process both shared one core and acks queued for seconds at 16 robots x 30 Hz (both measured:
  docs/store.md, Durability: log first, then Zarr). The writer runs
  at a lower CPU priority (``store_writer_nice``, default 10): its work can wait (the log holds it, and
  backpressure bounds it), acks cannot, so when the cores are busy the intake goes first. A writer that
  dies is restarted and replays its episodes' logs from their Zarr commits.
* **Sequence numbers are frame indices.** A frame's seq is its index in its episode, so what is durable
  is one number per episode: ``committed`` = frames in the log (Zarr holds a prefix of them). A batch
  below it is a duplicate (acknowledged, dropped), one that overlaps it is trimmed, one beyond it is a
  gap and is refused (streams are ordered, so the reorder window is zero).
* **Restart = replay.** On start, every log of an open episode is replayed from the Zarr commit on
  (a torn last record, which was never acknowledged, is cut off); a robot that reconnects re-sends
  ``StartEpisode`` and everything not acknowledged, and duplicates are dropped against that state.
  Once an episode is closed in the store its log is deleted.
* **Backpressure.** Log bytes waiting for the store writers are bounded; past the bound a stream
  is not read until they catch up, so gRPC flow control slows the robots (whose clients keep what is
  not acknowledged) instead of the collector growing without bound.

Security: the stream and stats calls need ``authorization: Bearer <token>`` when a token is set;
without one the collector refuses to bind anything but loopback. Nothing is ever unpickled. With
``robot_tokens`` (``--robot-tokens-file``) each credential is bound to one robot id: its ``Hello`` may
only name that robot (else ``PERMISSION_DENIED``), and its ``GetStats`` shows that robot alone. The
shared token (if any) stays the operator's: it may speak as any robot. ``/metrics`` has no
authentication: it binds ``metrics_host`` (loopback by default) and ``metrics_robot_labels=False``
keeps robot ids out of it.

Limits (each a :class:`CollectorConfig` field and a ``vla-rl collect`` flag; a refusal names its limit):

* Every size a ``FrameBatch`` declares is checked before anything is counted or allocated
  (:func:`fleet.wal.batch_size`); undecodable messages get a ``Reject`` (``INVALID_ARGUMENT``), logged
  once per peer a minute.
* ``max_open_episodes_per_robot`` (16): more open at once is ``RESOURCE_EXHAUSTED``.
* ``episode_idle_timeout_s`` (1800): an episode without a message for that long is ended by the
  collector with outcome ``aborted`` (success false); its frames are kept.
* ``max_open_logs`` (256): log descriptors are a pool (least recently used closed, reopened on
  demand), so open episodes cost no descriptor and a restart with many logs needs none per log.
* ``max_camera_pixels`` (1280 x 720) per camera of a ``Hello``, and its robot spec at most 64 KiB of JSON
  (``vla_rl_client.spec.MAX_SPEC_JSON_CHARS``); ``max_buffered_mb`` (1024 MiB): the frame blocks a store
  writer holds, all episodes together, the free ones it keeps for reuse included (past it, those go, then
  least recently used episodes are flushed to Zarr and let go); it reads a log one record at a time.
* ``max_value_abs`` (1e6): the largest |value| of a frame's state, action, proposed action or reward;
  actions must also lie in the spec's ``action_range`` (``INVALID_ARGUMENT`` naming the field and frame).
* A store write failing with ENOSPC / EDQUOT / EMFILE / ENFILE is retried with a backoff doubling up
  to ``store_retry_max_s`` (metric ``store_write_retries``); other store errors fail the episode.
* ``lease_ttl_s`` (30): on an object store, the collector holds ``<prefix>/.collector-lease``
  (:class:`fleet.objstore.StoreLease`), renewed every third of it; a second collector on the same
  prefix refuses to start naming the holder, and takes over only once the holder stopped renewing for
  that long.
* ``drain_timeout_s`` (5): the most :meth:`Collector.stop` (SIGTERM) takes. Past it the store writers
  are killed: everything acknowledged is in the log and is replayed on the next start; what was not
  acknowledged the robots resend.

The package, by job:

* :mod:`fleet.collector.config`: :class:`CollectorConfig`, every knob typed and validated once (no secrets);
* :mod:`fleet.collector.rpc`: the gRPC service on the shell it shares with the policy server
  (:mod:`vla_rl.core.rpc`: status errors, rate-limited logs, undecodable requests, bearer tokens, SIGTERM):
  the service's methods, sessions, credential checks, refusals, the event loop, credential files;
* :mod:`fleet.collector.episodes`: the per-episode state machine (hello, start, frames, segment, end);
* :mod:`fleet.collector.writers`: the store writer handles (a thread, or a ``fleet.store_writer`` process);
* :mod:`fleet.collector.metrics`: Prometheus metrics and per-robot accounts;
* :mod:`fleet.collector.collector`: :class:`Collector` itself (start, drain, stop, the store lock and
  lease, recovery, the writer pool's bookkeeping) and :func:`serve`.
"""

from fleet.collector.collector import Collector, serve
from fleet.collector.config import CollectorConfig
from fleet.collector.rpc import RequestError, load_robot_tokens, read_token_file

__all__ = ["Collector", "CollectorConfig", "RequestError", "load_robot_tokens", "read_token_file", "serve"]
