"""Names, limits and defaults of the worker side: environment variables the master passes to each
agent, frame and field limits of the rendezvous protocol, timings.

The worker side is the lower layer: textsql imports these names, never the other way round.
"""

DEFAULT_SSH_PORT = 2222
DEFAULT_RENDEZVOUS_PORT = 29400

# Environment variables the master sets for every agent (never the token itself on a command line).
ENV_RENDEZVOUS = "TEXTSQL_RENDEZVOUS"  # "HOST:PORT" of the master's rendezvous server
ENV_TOKEN_FILE = "TEXTSQL_RENDEZVOUS_TOKEN_FILE"  # path of a file holding the per-run token
# The one group besides the owner allowed to read the token file: a Kubernetes pod's fsGroup, which
# the kubelet gives the mounted Secret's files (mode 0440) and the pod's processes.
ENV_TOKEN_GROUP = "TEXTSQL_RENDEZVOUS_TOKEN_GROUP"
ENV_TOKEN = "TEXTSQL_RENDEZVOUS_TOKEN"  # the token itself, for platforms without a shared filesystem
ENV_CLIENT_PUBKEY = "TEXTSQL_CLIENT_PUBKEY"  # the run's ssh client public key, the only one sshd accepts
ENV_SSH_PORT = "TEXTSQL_SSH_PORT"
ENV_ADDRESS = "TEXTSQL_WORKER_ADDRESS"  # explicit address override
ENV_SLOTS = "TEXTSQL_WORKER_SLOTS"
ENV_POD = "TEXTSQL_WORKER_POD"  # the backend's name for this worker, reported back to find missing ones
ENV_WORKER_DIR = "TEXTSQL_WORKER_DIR"  # where the agent keeps its sshd files
ENV_DEADLINE = "TEXTSQL_REGISTER_DEADLINE"  # seconds the agent keeps retrying registration
ENV_SSHD = "TEXTSQL_WORKER_SSHD"  # "0" runs register-only (no sshd), for benchmarks
# Where sshd's authorized key goes when the home directory is read-only (a pod's readOnlyRootFilesystem):
# a directory on a volume the kubelet makes world-writable, so sshd runs with StrictModes off there.
ENV_SSHD_KEYS_DIR = "TEXTSQL_SSHD_KEYS_DIR"
# The agent's local socket for its ranks' heartbeats (worker.beats), set by the agent for its ssh sessions.
ENV_BEAT_SOCKET = "TEXTSQL_BEAT_SOCKET"
# For tests: JSON {"POD" or "*": {inventory field: value}} a worker reports instead of what it found.
ENV_INVENTORY_OVERRIDES = "TEXTSQL_WORKER_INVENTORY_OVERRIDES"

# Platform variables holding the pod's own address, tried in order.
PLATFORM_ADDRESS_VARS = ("CDSW_IP_ADDRESS", "POD_IP")
# Platform variables holding the pod's own name or id.
PLATFORM_POD_VARS = ("CDSW_ENGINE_ID", "HOSTNAME")

# The variables naming the network interface NCCL and gloo use.
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Environment of the agent that remote ssh sessions (pdsh, DeepSpeed's launcher) inherit through
# sshd's SetEnv, so a rank process sees the pod's interpreter, libraries and caches.
FORWARDED_ENV = (
    "PATH",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "CUDA_HOME",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HF_HOME",
    "TORCH_EXTENSIONS_DIR",
    "LANG",
    "LC_ALL",
    # The interface carrying this pod's address (worker.inventory), unless the pod's own environment names one:
    # per host, which DeepSpeed's .deepspeed_env (one file for every host) cannot say.
    *SOCKET_IFNAME_VARS,
    # Where this pod's ranks send their heartbeats: to this pod's own agent.
    ENV_BEAT_SOCKET,
)

# What a worker agent inherits from the master's environment, by name (an allow-list: never the master's environment
# minus a deny-list, which lets through every credential it forgot): the runtime (interpreter, libraries, caches,
# locale, the user and their home), what sshd forwards to the ranks anyway. Store, tracking and hub credentials
# stay with the master; the rest an agent gets is named by the run (its rendezvous settings, its key, the run's env).
INHERITED_ENV = (*(name for name in FORWARDED_ENV if name != ENV_BEAT_SOCKET), "HOME", "USER", "LOGNAME", "TZ")

# Rendezvous protocol limits.
PROTOCOL_VERSION = 2  # 2: a held worker relays its ranks' heartbeats (worker.beats)
MAX_FRAME_BYTES = 16 * 1024  # a registration is a few hundred bytes; an ssh public key under 1 KiB
MAX_FRAME_DEPTH = 8  # a register message nests 2 levels; nothing honest nests deeper than this
# A held worker's frames: "beats" with at most MAX_SLOTS heartbeats (under 1 KiB as an agent sends it) or "detach".
# A larger one is refused by its length prefix, unread: no padding beside the signed fields is ever parsed.
MAX_RELAYED_FRAME_BYTES = 2 * 1024
READ_TIMEOUT_S = 10.0  # a whole frame must arrive within this, however slowly it drips
# The master's deadline for a new connection's registration: a worker sends it as soon as the hello
# arrives, so only an idle or hostile peer needs longer, and it must not hold a slot for long.
REGISTER_TIMEOUT_S = 3.0
HEARTBEAT_S = 5.0  # master -> worker keepalive on the held connection
MASTER_GONE_AFTER_S = 3 * HEARTBEAT_S  # no frame for this long: the master is gone
# How long the master waits for a released worker to hang up: the backend stops pods right after, and a
# worker stopped before it has read its release is killed instead of shutting down by itself.
RELEASE_HANGUP_S = 2.0
MAX_CONNECTIONS = 512  # connections handled at once; more are closed at accept
# Connections one address may hold before they authenticate: a worker needs one, so a flood from
# one address cannot take the slots of the others. Authenticated (held) connections do not count.
MAX_UNAUTHENTICATED_PER_ADDRESS = 64
REFUSAL_LOG_INTERVAL_S = 5.0  # one log line per kind of refusal per this many seconds
MAX_SLOTS = 16  # GPUs per worker
# Frames a held worker's connection is read for at most: a burst, then so many a second (a token bucket). Its ranks
# beat every 5 s each, so an honest pod sends at most MAX_SLOTS frames in 5 s; a flood's frames past the rate wait
# unread in TCP's buffers, and its sends block, costing the master nothing.
RELAYED_FRAMES_BURST = 2 * MAX_SLOTS
RELAYED_FRAMES_PER_S = 8.0
# A rank's heartbeat datagram to its agent is a few numbers; anything longer is not one.
MAX_BEAT_BYTES = 64
MAX_EXPECTED_WORKERS = 1024
SSH_KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)

# Agent timings.
REGISTER_DEADLINE_S = 600.0
BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 5.0
SSHD_START_TIMEOUT_S = 15.0
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this
# Worker sshd: unauthenticated connections one address may hold (the master needs one per pdsh launch or
# probe), and seconds a connection has to log in (OpenSSH's default is 120).
SSHD_PER_SOURCE_STARTUPS = 16
SSHD_LOGIN_GRACE_S = 20
# The master's ssh probe of a worker: attempts, and the pause before the second (doubling after), before
# the worker counts as not answering.
SSH_PROBE_ATTEMPTS = 3
SSH_PROBE_BACKOFF_S = 2.0

# Run-dir file names written by the worker side.
HOSTFILE_NAME = "hostfile"
KNOWN_HOSTS_NAME = "known_hosts"
SSH_CONFIG_NAME = "ssh_config"
TOKEN_NAME = "rendezvous.token"
IDENTITY_NAME = "id_ed25519"
WORKERS_DIR_NAME = "workers"

SSHD_PATH = "/usr/sbin/sshd"
INSTALL_SSH_HINT = "install it with: apt-get install -y openssh-server openssh-client (or run `make setup`)"
