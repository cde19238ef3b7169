"""A durable buffer in front of the history store: pushes return fast, Delta gets batches.

Three modules: ``record`` (the format), ``journal`` (the files), ``lanes`` (appends, drains,
the threads).


Each process appends its pushes to a journal per lane, ``<data_dir>/buffer/<lane>/<seq>-<pid>.journal``
(lanes: a view's history, ``view:<name>``, or a push source's log, ``log:<name>``), and a push
returns once its record is durable. A journal is preallocated with zeros, so making a record
durable is an ``fdatasync`` of its bytes alone: no new file, no directory fsync, no file-system
journal commit (a third of the old segment-per-push fsync; the next journal is zero-filled in
the background, ready when the current one fills or a drain takes it). ``drain`` later commits a lane's records, one
Delta append per target, and deletes its journals; a push that finds its lane due starts that
on the process's committing thread (``in_background``) and returns.

A record is a header (``RECORD``: magic, payload length, CRC-32 of the payload, sequence, rows,
flags) and a payload of parts, each a target's name and its rows as an Arrow IPC stream: a push
to both stores writes the source's log and its views' history as one record of the log's lane.
A drain decodes the parts of one target and schema in one go: their streams joined into one
(a record per call cost ~50 µs of a commit's CPU, which pushes beside it felt).

Crash safety: a record is ``PENDING`` until its online write is confirmed; the push then clears
the flag. ``drain`` re-sends pending records online first (online writes are idempotent), so
history never holds rows Redis lacks. The online write runs while the record's ``fdatasync``
is in flight, once its bytes are written (in the page cache): a killed process leaves a complete
pending record. A journal is read up to its first invalid record: zeros (its end) or a record
torn by a writer killed mid-write or a power loss before its sync. Such a record was
acknowledged to no one and its rows never reached Redis (nor did any after it: a process writes
its records in order and each sync covers the earlier ones); ``drain`` keeps the journal as
``.torn`` and says so. The one exception: a power loss in the ~0.3 ms between the online write
and the end of the sync, if Redis persisted the rows in that time (the embedded server fsyncs
its log every second), leaves them in Redis only, unacknowledged. History appends dedupe by row
identity; push-log appends carry a Delta app transaction (``featurestore-buffer``, version =
the newest record's sequence), so a drain that crashed after its commit but before deleting
its journals never appends them twice. A log is written from its own lane only, so those
versions only grow. (Segment files of one record each, ``<seq>-<pid>-<rows>[-retry].<state>.arrow``,
written by earlier versions, drain as before.)

Concurrency: writers take a shared lock (``.lock``) while writing a record; ``drain`` takes it
exclusively only to take the lane's journals (renamed ``.draining``; a writer's next record goes
to a new journal), so it sees only complete records and writers never wait for Delta. Drains
serialize on ``.drain-lock``, so no two commit the same record. Threads of one process share its
journal; a replaced journal's descriptor closes with its last in-flight push.
"""

from featurestore.offline.buffer.lanes import APP_ID, PushBuffer
from featurestore.offline.buffer.record import MAGIC, RECORD, Record

__all__ = ["APP_ID", "PushBuffer", "Record", "MAGIC", "RECORD"]
