package main

import (
	"flag"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/numa"
	"github.com/gorunhq/gorun/launcher"
	"github.com/gorunhq/gorun/rendezvous"
)

// The root command is the launcher: `gorun [flags] [--] PROGRAM [ARGS…]`
// takes torchrun's command line. Each torchrun flag is spelled with dashes
// (its name) and with underscores (an alias), and also reads PET_<NAME>
// from the environment, as torchrun's argparse actions do; the command
// line wins over the environment. gorun's own flags read GORUN_<NAME>.

const launchUsage = "gorun [flags] PROGRAM [ARGS…]"

const launchDescription = `Runs PROGRAM once per local rank under torchrun's rules and environment:
with $PYTHON_EXEC (else python3) as "python -u PROGRAM ARGS…", "python -u -m
PROGRAM ARGS…" with -m, or PROGRAM itself with --no-python. Every torchrun flag
has both spellings (--nproc-per-node, --nproc_per_node) and reads PET_<NAME>
(PET_NPROC_PER_NODE), as torchrun does; the command line wins. Flags go before
PROGRAM: everything after it is passed to PROGRAM untouched. A program named
like a gorun command (store, help) must follow --: gorun -- store.`

// Help categories for the launcher's flags.
const (
	catSize    = "Nodes and workers"
	catRdzv    = "Rendezvous"
	catStatic  = "Static rendezvous (torch.distributed.launch compatible)"
	catWorkers = "Workers"
	catLogs    = "Worker logs"
	catCompat  = "Accepted for torchrun compatibility"
	catGorun   = "gorun"
	catFT      = "Fault tolerance (gorun)"
)

// torchAliases returns a torchrun flag's other spellings: the underscore
// form of a multi-word name, then any short names.
func torchAliases(name string, short ...string) []string {
	var aliases []string
	if u := strings.ReplaceAll(name, "-", "_"); u != name {
		aliases = append(aliases, u)
	}
	return append(aliases, short...)
}

// petVar is the variable torchrun's env action reads for a flag:
// PET_ and the longest spelling upper-cased with '-' → '_'.
func petVar(name string) string {
	return "PET_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// torchString is a torchrun flag taking a string.
func torchString(cat, name, value, usage string, short ...string) *cli.StringFlag {
	return &cli.StringFlag{Name: name, Aliases: torchAliases(name, short...), Value: value,
		Usage: usage, EnvVars: []string{petVar(name)}, Category: cat}
}

// torchBool is a torchrun check_env switch: present means on, and
// PET_<NAME>=1 or 0 (also true or false) sets it from the environment.
func torchBool(cat, name, usage string, short ...string) *cli.BoolFlag {
	return &cli.BoolFlag{Name: name, Aliases: torchAliases(name, short...),
		Usage: usage, EnvVars: []string{petVar(name)}, Category: cat}
}

func torchInt(cat, name string, value int, usage string) *cli.IntFlag {
	return &cli.IntFlag{Name: name, Aliases: torchAliases(name), Value: value,
		Usage: usage, EnvVars: []string{petVar(name)}, Category: cat}
}

// torchSeconds is a torchrun flag holding seconds (a float, as
// --monitor-interval is in torchrun); more variables may follow PET_'s.
func torchSeconds(cat, name string, value time.Duration, usage string, moreEnv ...string) *cli.Float64Flag {
	return &cli.Float64Flag{Name: name, Aliases: torchAliases(name), Value: value.Seconds(),
		Usage: usage, EnvVars: append([]string{petVar(name)}, moreEnv...), Category: cat}
}

// launchFlags are torchrun's flags (its --help, 1.13 to 2.14) with its
// defaults, plus gorun's own.
func launchFlags() []cli.Flag {
	def := launcher.DefaultConfig()
	return []cli.Flag{
		torchString(catSize, "nnodes", "1:1", "number of nodes, `N` or MIN:MAX (elastic, needs a dynamic --rdzv-backend)"),
		torchString(catSize, "nproc-per-node", "1", "workers on this node: an integer, auto (GPUs, else CPUs), cpu or gpu"),

		torchString(catRdzv, "rdzv-backend", "static", "rendezvous backend: static, c10d, etcd-v2 or etcd"),
		torchString(catRdzv, "rdzv-endpoint", "", "rendezvous endpoint `HOST[:PORT]` (c10d's default port is 29400); for etcd HOST:PORT[,HOST:PORT…] (default port 2379)"),
		torchString(catRdzv, "rdzv-id", def.Rendezvous.RunID, "job id, the same on every node"),
		torchString(catRdzv, "rdzv-conf", "", "rendezvous options `K=V,…` (join_timeout, last_call_timeout, read_timeout, is_host, store_type, …; etcd: protocol, cacert, cert, key, user, password_env, prefix, lease_ttl, start_lease_ttl)"),
		torchBool(catRdzv, "standalone", "single node: host a c10d rendezvous on localhost at a free port with a random id (ignores --rdzv-*)"),
		torchString(catRdzv, "local-addr", "", "`ADDRESS` this node advertises (default: its FQDN)"),

		torchString(catStatic, "master-addr", def.Rendezvous.MasterAddr, "`HOST` of node rank 0 for --rdzv-backend static"),
		torchInt(catStatic, "master-port", def.Rendezvous.MasterPort, "`PORT` on node rank 0 for --rdzv-backend static"),
		torchInt(catStatic, "node-rank", def.Rendezvous.NodeRank, "this node's rank for --rdzv-backend static"),

		torchBool(catWorkers, "module", "run PROGRAM as a module: python -m PROGRAM", "m"),
		torchBool(catWorkers, "no-python", "run PROGRAM itself, not with python"),
		torchBool(catWorkers, "run-path", "torchrun's runpy.run_path; gorun runs python -u PROGRAM (wins over --no-python)"),
		torchString(catWorkers, "role", def.Role, "workers' role name (ROLE_NAME, log prefixes)"),
		torchInt(catWorkers, "max-restarts", def.MaxRestarts, "restarts of the worker group after a failure before the job fails"),
		torchSeconds(catWorkers, "monitor-interval", def.MonitorInterval, "health poll period in `SECONDS` (gorun sees worker exits at once)"),
		torchString(catWorkers, "signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "signals forwarded to the workers, comma-separated (add SIGUSR1,SIGUSR2 under SLURM)"),
		torchSeconds(catWorkers, "shutdown-timeout", def.ShutdownTimeout, "`SECONDS` stopped workers get before SIGKILL",
			"TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
		torchSeconds(catWorkers, "exit-barrier-timeout", def.ExitBarrierTimeout, "`SECONDS` a finished node waits for the other nodes",
			"TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT"),

		torchString(catLogs, "log-dir", "", "base `DIR` for worker logs (default: a new torchelastic_* temporary directory)"),
		torchString(catLogs, "redirects", "0", "streams sent to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank like 0:1,1:2", "r"),
		torchString(catLogs, "tee", "0", "streams sent to log files and the console (same format as --redirects)", "t"),
		torchString(catLogs, "local-ranks-filter", "", "only these local `RANKS` (e.g. 0,1) reach the console; files keep everything"),
		&cli.StringFlag{Name: "log-line-prefix-template", Aliases: torchAliases("log-line-prefix-template"),
			Usage:   "prefix of each worker line on the console; ${role_name}, ${local_rank}, ${rank}, ${hostname} are filled in (default \"[${role_name}${local_rank}]:\")",
			EnvVars: []string{petVar("log-line-prefix-template"), "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"}, Category: catLogs},
		torchString(catLogs, "duplicate-stdout-filters", "", "copy tee'd stdout lines containing any of these comma-separated `STRINGS` (\",,\" is a comma) to filtered_stdout.log in the attempt's log dir"),
		torchString(catLogs, "duplicate-stderr-filters", "", "the same for stderr, to filtered_stderr.log"),
		torchBool(catWorkers, "virtual-local-rank", "every worker gets LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES"),
		torchString(catWorkers, "numa-binding", "", "bind each worker's CPUs near its GPU (local rank i: CUDA device i); `MODE` is node (the GPU's NUMA node), "+
			"socket (its socket), exclusive (a disjoint share of the node's physical cores) or core-complex (one L3 cache domain); "+
			"exit code 8 when this machine cannot (no GPU for a rank, no NUMA information, too few cores)"),
		torchString(catCompat, "print-completion", "", "print a completion script for `SHELL` (bash, zsh or tcsh) and exit"),

		torchString(catCompat, "start-method", def.StartMethod, "spawn, fork or forkserver; only affects Python function entrypoints, so no effect here"),
		torchString(catCompat, "event-log-handler", "null", "torchelastic event handler name; ignored (gorun logs events itself)"),
		torchString(catCompat, "logs-specs", "", "torchrun.logs_specs plugin name; ignored (Python plugins only)"),

		&cli.BoolFlag{Name: "init", Usage: "insist on PID 1's duties when not PID 1: gorun always becomes a child subreaper that reaps and, when a worker group ends, kills what the workers leave behind; with --init, failing to become one is an error, not a warning",
			EnvVars: []string{"GORUN_INIT"}, Category: catGorun},
		&cli.StringFlag{Name: "cgroup", Value: launcher.CgroupAuto, Usage: "give each worker a cgroup v2 of its own, so that all it starts ends with it " +
			"(setsid daemons too, and after gorun is SIGKILLed) and an OOM kill is named: auto (under gorun's own cgroup where it is writable, " +
			"else none), off, or the `PATH` of a cgroup v2 directory to use (exit code 8 if it cannot)",
			EnvVars: []string{"GORUN_CGROUP"}, Category: catGorun},
		&cli.StringFlag{Name: "health-addr", Usage: "serve /healthz, /readyz and /metrics (Prometheus) on `HOST:PORT`, e.g. :8080 " +
			"(default: 127.0.0.1:$" + healthPortVar + " when that is set, else no endpoint; :PORT serves every interface, e.g. for Kubernetes probes)",
			EnvVars: []string{"GORUN_HEALTH_ADDR"}, Category: catGorun},

		&cli.StringFlag{Name: "on-failure", Value: def.OnFailure,
			Usage:   "when a rank fails: restart (stop all workers, re-rendezvous, restart them: torchrun's way) or shrink (survivors shrink their groups and carry on)",
			EnvVars: []string{"GORUN_ON_FAILURE"}, Category: catFT},
		&cli.IntFlag{Name: "min-world-size", Value: def.MinWorldSize,
			Usage:   "shrink mode's floor: a failure that would leave fewer ranks restarts the group instead",
			EnvVars: []string{"GORUN_MIN_WORLD_SIZE"}, Category: catFT},
		&cli.Float64Flag{Name: "settle-window", Value: def.SettleWindow.Seconds(),
			Usage:   "`SECONDS` shrink mode gathers failure reports before deciding, so that failures seen together make one epoch",
			EnvVars: []string{"GORUN_SETTLE_WINDOW"}, Category: catFT},
		&cli.StringFlag{Name: "regrow", Value: "on",
			Usage:   "shrink mode's heal: `on` (respawn a rank that died, admit a node waiting to join in a lost node's place, and grow them back into the running group, the survivors never restarted) or off (the job runs on smaller)",
			EnvVars: []string{"GORUN_REGROW"}, Category: catFT},
		&cli.IntFlag{Name: "max-respawns", Value: def.MaxRespawns,
			Usage:   "shrink mode's heal: respawns the whole job may make (every node counts against it); once spent, a lost rank stays out",
			EnvVars: []string{"GORUN_MAX_RESPAWNS"}, Category: catFT},
		&cli.Float64Flag{Name: "respawn-backoff", Value: def.RespawnBackoff.Seconds(),
			Usage:   "`SECONDS` a lost rank waits before it is respawned; doubles with each respawn of the same rank, up to 30",
			EnvVars: []string{"GORUN_RESPAWN_BACKOFF"}, Category: catFT},
		&cli.IntFlag{Name: "respawn-standbys", Value: def.RespawnStandbys,
			Usage:   "shrink mode's heal: keep `N` workers pre-started on this node, parked (as --spare-prestart parks them), so that a lost rank's respawn takes one whose start-up is done instead of starting cold; it learns its slot (LOCAL_RANK, RANK, …) on $GORUN_ASSIGNMENT_FD",
			EnvVars: []string{"GORUN_RESPAWN_STANDBYS"}, Category: catFT},
		&cli.Float64Flag{Name: "grow-timeout", Value: def.GrowTimeout.Seconds(),
			Usage:   "`SECONDS` the ranks of a grow have to form the grown group; a newcomer that does not come is excluded again and the survivors go on",
			EnvVars: []string{"GORUN_GROW_TIMEOUT"}, Category: catFT},
		&cli.StringFlag{Name: "job-secret-file",
			Usage:   "read the job secret from `PATH` (every agent of the job holds the same one; at least 16 bytes, e.g. a mounted Kubernetes Secret): node liveness gossip is encrypted with it, and workers get it as $" + launcher.JobSecretEnv + " (default: $" + launcher.JobSecretEnv + "; --standalone makes one)",
			EnvVars: []string{"GORUN_JOB_SECRET_FILE"}, Category: catGorun},
		&cli.BoolFlag{Name: "spare-prestart",
			Usage:   "start the workers while this agent waits for its first round (a hot spare standing by, or a job still forming), parked before their first collective until the round's RANK, WORLD_SIZE, … reach them on $GORUN_ASSIGNMENT_FD (gorun_ft.await_assignment, Go's package prestart)",
			EnvVars: []string{"GORUN_SPARE_PRESTART"}, Category: catFT},
		&cli.Float64Flag{Name: "heartbeat-timeout", Value: 0,
			Usage:   "`SECONDS` without a heartbeat (to $GORUN_HEARTBEAT) after which a worker counts as hung and is killed; 0 turns hang detection off",
			EnvVars: []string{"GORUN_HEARTBEAT_TIMEOUT"}, Category: catFT},
		&cli.Float64Flag{Name: "done-timeout", Value: 0,
			Usage:   "`SECONDS` a worker that said it was done (a \"done\" heartbeat: gorun_ft's close()) may take to exit; past it, it is killed and counts as a success (its work was over; a worker says done only after training succeeded). 0 leaves its teardown unbounded. Needs --heartbeat-timeout",
			EnvVars: []string{"GORUN_DONE_TIMEOUT"}, Category: catFT},
		&cli.StringFlag{Name: "node-liveness", Value: def.NodeLiveness.Mode,
			Usage:   "several nodes: when agents gossip to find a crashed, frozen or cut-off node in about 0.6 s: `auto` (shrink mode only), on (restart mode too), off (the rendezvous keep-alive or etcd lease only)",
			EnvVars: []string{"GORUN_NODE_LIVENESS"}, Category: catFT},
		&cli.Float64Flag{Name: "node-probe-interval", Value: def.NodeLiveness.ProbeInterval.Seconds(),
			Usage:   "several nodes: `SECONDS` between an agent's liveness probes of another (memberlist); a silent node is declared dead after about 6 of them",
			EnvVars: []string{"GORUN_NODE_PROBE_INTERVAL"}, Category: catFT},
		&cli.IntFlag{Name: "node-suspicion-mult", Value: def.NodeLiveness.SuspicionMult,
			Usage:   "probe intervals a suspected node has to answer before it is declared dead; raise it on overloaded machines to avoid false verdicts",
			EnvVars: []string{"GORUN_NODE_SUSPICION_MULT"}, Category: catFT},
	}
}

// jobSecret is the job secret: --job-secret-file's contents, or
// $GORUN_JOB_SECRET's; nil when neither is given. It has no flag of its
// own, so that it never shows on a command line.
func jobSecret(c *cli.Context) (launcher.Secret, error) {
	text, inEnv := os.LookupEnv(launcher.JobSecretEnv)
	path := c.String("job-secret-file")
	switch {
	case path != "" && inEnv:
		return nil, usageErrorf("--job-secret-file and $%s both give a job secret: give one", launcher.JobSecretEnv)
	case path != "":
		s, err := launcher.ReadSecretFile(path)
		if err != nil {
			return nil, usageErrorf("--job-secret-file: %v", err)
		}
		return s, nil
	case inEnv:
		s, err := launcher.ParseSecret(text)
		if err != nil {
			return nil, usageErrorf("$%s: %v", launcher.JobSecretEnv, err)
		}
		return s, nil
	}
	return nil, nil
}

// healthPortVar is torchrun's health-check knob. torchrun passes it to a
// health-check server that is a no-op stub outside Meta; gorun serves its
// endpoint on loopback at that port when --health-addr (or
// GORUN_HEALTH_ADDR, even empty) is not given, so that a deployment that
// sets it for torchrun gets local probes from gorun. Loopback: /metrics
// says much about a job, and only the host should read it unless
// --health-addr says otherwise (a Kubernetes probe reaches the pod's IP:
// give --health-addr :PORT there).
const healthPortVar = "TORCHELASTIC_HEALTH_CHECK_PORT"

// healthAddr is --health-addr, or "127.0.0.1:PORT" from TORCHELASTIC_HEALTH_CHECK_PORT
// when the flag and GORUN_HEALTH_ADDR are both absent; "" for none.
func healthAddr(c *cli.Context) (string, error) {
	if c.IsSet("health-addr") {
		return c.String("health-addr"), nil
	}
	port := strings.TrimSpace(os.Getenv(healthPortVar))
	if port == "" {
		return "", nil
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 || strings.ContainsAny(port, "+-") {
		return "", usageErrorf("$%s %q is not a TCP port (0–65535)", healthPortVar, port)
	}
	return "127.0.0.1:" + port, nil
}

// runLaunch is the root command's action: build the Config, then run the
// agent until the job ends.
func runLaunch(c *cli.Context) error {
	if c.IsSet("print-completion") {
		return printCompletion(c.App.Writer, c.String("print-completion"), c.App)
	}
	if launcher.IsEtcdBackend(c.String("rdzv-backend")) && !launcher.EtcdBackendLinked {
		argv, _ := c.App.Metadata[argvKey].([]string)
		return handOverToEtcdBuild(argv) // returns only if it could not
	}
	log, err := newLogger(c)
	if err != nil {
		return err
	}
	defer log.Sync()
	cfg, err := launchConfig(c)
	if err != nil {
		return err
	}
	noteIgnoredFlags(c, log)
	// The guard that empties the workers' cgroups if gorun is SIGKILLed
	// is gorun itself (launcher/cgroup's init turns it guard before anything else runs).
	if exe, err := os.Executable(); err == nil && cfg.Cgroup != launcher.CgroupOff {
		cfg.CgroupGuard = exe
	}
	return launcher.Run(c.Context, cfg, log)
}

// launchConfig turns the command line and PET_* environment into the
// agent's Config: torchrun's defaults, overridden by what was given,
// parsed and validated. Every error is a usage error.
func launchConfig(c *cli.Context) (launcher.Config, error) {
	cfg := launcher.DefaultConfig()
	args := c.Args().Slice()
	if len(args) == 0 {
		return cfg, usageErrorf("no program to run (usage: %s)", launchUsage)
	}
	cfg.Entrypoint.Program = args[0]
	if len(args) > 1 {
		cfg.Entrypoint.Args = args[1:]
	}
	cfg.Entrypoint.Module = c.Bool("module")
	cfg.Entrypoint.NoPython = c.Bool("no-python")
	cfg.Entrypoint.RunPath = c.Bool("run-path")
	if py := os.Getenv("PYTHON_EXEC"); py != "" {
		cfg.Entrypoint.Python = py
	}

	var err error
	if cfg.MinNodes, cfg.MaxNodes, err = launcher.ParseNNodes(c.String("nnodes")); err != nil {
		return cfg, flagError(c, "nnodes", err)
	}
	if cfg.NProcPerNode, err = launcher.ResolveNProc(c.String("nproc-per-node")); err != nil {
		return cfg, flagError(c, "nproc-per-node", err)
	}
	cfg.Role = c.String("role")

	r := &cfg.Rendezvous
	r.Backend = c.String("rdzv-backend")
	r.Endpoint = c.String("rdzv-endpoint")
	r.RunID = c.String("rdzv-id")
	if r.Conf, err = launcher.ParseRdzvConf(c.String("rdzv-conf")); err != nil {
		return cfg, flagError(c, "rdzv-conf", err)
	}
	r.Standalone = c.Bool("standalone")
	r.MasterAddr = c.String("master-addr")
	r.MasterPort = c.Int("master-port")
	r.NodeRank = c.Int("node-rank")
	r.LocalAddr = c.String("local-addr")

	cfg.MaxRestarts = c.Int("max-restarts")
	cfg.OnFailure = c.String("on-failure")
	cfg.MinWorldSize = c.Int("min-world-size")
	cfg.MaxRespawns = c.Int("max-respawns")
	cfg.RespawnStandbys = c.Int("respawn-standbys")
	switch v := strings.ToLower(c.String("regrow")); v {
	case "on", "true", "1":
		cfg.Regrow = true
	case "off", "false", "0":
		cfg.Regrow = false
	default:
		return cfg, usageErrorf("--regrow %q: want on or off", c.String("regrow"))
	}
	cfg.SparePrestart = c.Bool("spare-prestart")
	if cfg.JobSecret, err = jobSecret(c); err != nil {
		return cfg, err
	}
	cfg.NodeLiveness.Mode = c.String("node-liveness")
	cfg.NodeLiveness.SuspicionMult = c.Int("node-suspicion-mult")
	cfg.StartMethod = c.String("start-method")
	for _, d := range []struct {
		flag string
		dst  *time.Duration
	}{
		{"monitor-interval", &cfg.MonitorInterval},
		{"shutdown-timeout", &cfg.ShutdownTimeout},
		{"exit-barrier-timeout", &cfg.ExitBarrierTimeout},
		{"settle-window", &cfg.SettleWindow},
		{"respawn-backoff", &cfg.RespawnBackoff},
		{"grow-timeout", &cfg.GrowTimeout},
		{"heartbeat-timeout", &cfg.HeartbeatTimeout},
		{"done-timeout", &cfg.DoneTimeout},
		{"node-probe-interval", &cfg.NodeLiveness.ProbeInterval},
	} {
		if *d.dst, err = seconds(c.Float64(d.flag)); err != nil {
			return cfg, usageErrorf("--%s: %v", d.flag, err)
		}
	}
	if cfg.SignalsToHandle, err = launcher.ParseSignals(c.String("signals-to-handle")); err != nil {
		return cfg, flagError(c, "signals-to-handle", err)
	}

	cfg.LogDir = c.String("log-dir")
	if cfg.Redirects, err = launcher.ParseStd(c.String("redirects")); err != nil {
		return cfg, flagError(c, "redirects", err)
	}
	if cfg.Tee, err = launcher.ParseStd(c.String("tee")); err != nil {
		return cfg, flagError(c, "tee", err)
	}
	if cfg.LocalRanksFilter, err = parseLocalRanks(c.String("local-ranks-filter")); err != nil {
		return cfg, flagError(c, "local-ranks-filter", err)
	}
	cfg.LogLinePrefixTemplate = c.String("log-line-prefix-template")
	cfg.DuplicateStdoutFilters = parseFilters(c.String("duplicate-stdout-filters"))
	cfg.DuplicateStderrFilters = parseFilters(c.String("duplicate-stderr-filters"))
	cfg.VirtualLocalRank = c.Bool("virtual-local-rank")
	if cfg.NUMABinding = c.String("numa-binding"); cfg.NUMABinding != "" {
		if _, err := numa.ParseMode(cfg.NUMABinding); err != nil {
			return cfg, flagError(c, "numa-binding", err)
		}
	}
	cfg.Init = c.Bool("init")
	cfg.Cgroup = c.String("cgroup")
	if cfg.HealthAddr, err = healthAddr(c); err != nil {
		return cfg, err
	}
	// Validate also records the parsed rendezvous settings in cfg.
	err = cfg.Validate()
	return cfg, err
}

// flagError prefixes a parse error with the flag, and with its PET_
// variable when the bad value came from there.
func flagError(c *cli.Context, name string, err error) error {
	label := "--" + name
	if v, ok := os.LookupEnv(petVar(name)); ok && v == c.String(name) {
		label += " (from $" + petVar(name) + ")"
	}
	return usageErrorf("%s: %w", label, err)
}

// seconds converts torchrun's float seconds to a Duration. Negative values
// pass through for Validate to name the flag's own rule.
func seconds(s float64) (time.Duration, error) { return rendezvous.SecondsDuration(s) }

// parseLocalRanks reads --local-ranks-filter: comma-separated local ranks;
// "" means no filter (nil). Repeats are dropped and the result sorted.
func parseLocalRanks(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var ranks []int
	for _, part := range strings.Split(s, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(part))
		if err != nil || r < 0 {
			return nil, usageErrorf("%q: %q is not a local rank; want e.g. 0,1,2", s, part)
		}
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	return slices.Compact(ranks), nil
}

// noteIgnoredFlags logs the flags gorun accepts without acting on them, so
// that a torchrun command line runs but nobody is misled.
func noteIgnoredFlags(c *cli.Context, log *zap.Logger) {
	if h := c.String("event-log-handler"); h != "null" {
		log.Debug("--event-log-handler is accepted for torchrun compatibility and ignored; gorun logs its events itself",
			zap.String("handler", h))
	}
	if m := c.String("start-method"); m != launcher.DefaultConfig().StartMethod {
		log.Debug("--start-method only affects Python function entrypoints; it has no effect on programs",
			zap.String("start_method", m))
	}
	if s := c.String("logs-specs"); s != "" {
		log.Warn("--logs-specs names a Python LogsSpecs plugin, which gorun cannot load; using torchrun's default log layout",
			zap.String("logs_specs", s))
	}
	standalone := c.Bool("standalone")
	if standalone && (c.IsSet("rdzv-backend") || c.IsSet("rdzv-endpoint") || c.IsSet("rdzv-id")) {
		log.Warn("--standalone ignores --rdzv-backend, --rdzv-endpoint and --rdzv-id")
	}
	if !standalone && c.String("rdzv-backend") != "static" && (c.IsSet("master-addr") || c.IsSet("master-port")) {
		// torchrun warns likewise.
		log.Warn("--master-addr and --master-port are only used with --rdzv-backend static")
	}
}

// programAfterDashDash reports whether args (without argv[0]) put "--"
// before the first positional argument. urfave/cli would still take that
// argument for a command name (`gorun -- store` would run `gorun store`),
// so the caller turns command dispatch off: after "--" comes a program.
//
// It parses args as the root command would, with a throwaway flag set
// built from the same flags, so that a flag's value is never taken for
// the program.
func programAfterDashDash(flags []cli.Flag, args []string) bool {
	fs := scanFlagSet(flags)
	if fs.Parse(args) != nil {
		return false // urfave/cli reports it
	}
	consumed := len(args) - fs.NArg()
	if consumed == 0 || args[consumed-1] != "--" {
		return false
	}
	// The "--" may have been a flag's value (`--role -- x`); then the
	// arguments before it do not parse on their own.
	before := scanFlagSet(flags)
	return before.Parse(args[:consumed-1]) == nil && before.NArg() == 0
}

// scanFlagSet is a flag set with the names of flags (and urfave/cli's help
// and version flags) that records nothing: it only tells flags, their
// values and the first positional argument apart.
func scanFlagSet(flags []cli.Flag) *flag.FlagSet {
	fs := flag.NewFlagSet("gorun", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	for _, f := range append(slices.Clone(flags), cli.HelpFlag, cli.VersionFlag) {
		if f == nil {
			continue
		}
		takesValue := true
		if d, ok := f.(cli.DocGenerationFlag); ok {
			takesValue = d.TakesValue()
		}
		for _, name := range f.Names() {
			switch {
			case fs.Lookup(name) != nil:
			case takesValue:
				fs.String(name, "", "")
			default:
				fs.Bool(name, false, "")
			}
		}
	}
	return fs
}

// parseFilters reads a --duplicate-std*-filters list as torchrun's
// comma_separated_list does: split at commas, ",," standing for a comma in
// a filter. An empty value is no filter.
func parseFilters(s string) []string {
	if s == "" {
		return nil
	}
	const placeholder = "\x00"
	parts := strings.Split(strings.ReplaceAll(s, ",,", placeholder), ",")
	for i, p := range parts {
		parts[i] = strings.ReplaceAll(p, placeholder, ",")
	}
	return parts
}
