"""The checkpoint store: a run's checkpoints and trained model copied to object storage, and a run resumed from it.

``--checkpoint-store URI`` names any fsspec location (``s3://bucket/prefix``, ``gs://``, ``abfs://``, ``file://``).
The master (the process that launches and supervises the ranks) copies each checkpoint there once the ranks have
marked it complete, in a thread beside training, and marks it complete in the store by one object written last;
a new launch with an empty run directory downloads the newest checkpoint marked complete before any rank starts.
The ranks never see the store or its credentials: they write and read the run directory as without a store.

- ``location`` (:mod:`textsql.store.location`): the URI opened through fsspec, and the checks before anything starts (scheme and
  its package, bucket, keys, write permission), each failure one line;
- ``sync`` (:mod:`textsql.store.sync`): a checkpoint uploaded and marked, the complete ones listed, the newest downloaded,
  retention, and the run's outputs at its end;
- ``copying`` (:mod:`textsql.store.copying`): files copied between the run directory and the store by descriptor,
  never through a link a worker planted;
- ``uploads`` (:mod:`textsql.store.uploads`): the background thread that uploads each new complete checkpoint, one at a time,
  with retries, and records the bytes and seconds.
"""
