"""The authenticated rendezvous: workers register over TCP, the master writes the run's files.

Modules, split the way :mod:`socketserver` keeps a server apart from its handler:

- ``server``: :class:`~worker.rendezvous.server.RendezvousServer` (listens, keeps the registrations, writes the
  files, releases) and ``textsql rendezvous serve``;
- ``registry``: which workers a run has, and the rules for joining and leaving it;
- ``handler``: one worker's connection on the master, from hello to release;
- ``client``: the worker's side (:func:`~worker.rendezvous.client.register`, a held
  :class:`~worker.rendezvous.client.Session`) and ``textsql rendezvous register``;
- ``token``: the per-run token file both sides read.

Conversation on one connection (frames and signatures from :mod:`worker.protocol`)::

    master -> worker  {"type": "hello", "version": 1, "nonce": SN}
    worker -> master  {"type": "register", "nonce": CN, "worker": {...}, "mac": HMAC(token, "register", SN, CN, worker)}
    master -> worker  {"type": "accepted" | "rejected", "reason": ..., "mac": HMAC(token, type, SN, CN, reason)}
    master -> worker  {"type": "heartbeat"} every few seconds while the run lasts, and meanwhile
    worker -> master  {"type": "beats", "sequence": N, "beats": [[RANK, STEP, PROGRESS], ...],
                       "mac": HMAC(token, "beats", SN, CN, N, beats)} as its ranks' heartbeats arrive, then
    master -> worker  {"type": "released", "mac": HMAC(token, "released", SN, CN)}

(``token``: the pod's key.) The worker holds its connection open after it is accepted: the master sees a worker
that dies before the run is complete (its registration is dropped), and the worker sees the master go away (no
heartbeat, or the connection closes) as well as its release, without polling. The "beats" frames carry the
ranks' heartbeats (:mod:`worker.beats`): each sequence number higher than the last, no field besides the signed
ones, and no larger than :data:`~worker.constants.MAX_RELAYED_FRAME_BYTES` (refused unread), or the connection is
dropped; past :data:`~worker.constants.RELAYED_FRAMES_BURST` frames, a held connection is read at most
:data:`~worker.constants.RELAYED_FRAMES_PER_S` frames a second, the rest left waiting in TCP's buffers.
"""
