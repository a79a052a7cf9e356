package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/gorunhq/gorun/launcher"
)

// The Kubernetes examples (examples/k8s) are checked here, next to the
// CLI, so that their command lines and environments go through gorun's
// real flag parsing: a manifest that gorun would refuse, or read
// differently from what it means, fails the build.

const k8sDir = "../../examples/k8s"

// The slices of the Kubernetes API the checks read. Fields are tagged
// because the API spells them in camelCase.
type (
	k8sMeta struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	}
	k8sService struct {
		Metadata k8sMeta `yaml:"metadata"`
		Spec     struct {
			ClusterIP                string            `yaml:"clusterIP"`
			PublishNotReadyAddresses bool              `yaml:"publishNotReadyAddresses"`
			Selector                 map[string]string `yaml:"selector"`
			Ports                    []k8sPort         `yaml:"ports"`
		} `yaml:"spec"`
	}
	k8sPort struct {
		Name          string `yaml:"name"`
		Port          int    `yaml:"port"`
		ContainerPort int    `yaml:"containerPort"`
	}
	k8sEnv struct {
		Name      string         `yaml:"name"`
		Value     *string        `yaml:"value"`
		ValueFrom map[string]any `yaml:"valueFrom"`
	}
	k8sProbe struct {
		HTTPGet *struct {
			Path string `yaml:"path"`
			Port any    `yaml:"port"` // a number or a port name
		} `yaml:"httpGet"`
	}
	k8sContainer struct {
		Name           string    `yaml:"name"`
		Image          string    `yaml:"image"`
		Command        []string  `yaml:"command"`
		Args           []string  `yaml:"args"`
		Env            []k8sEnv  `yaml:"env"`
		Ports          []k8sPort `yaml:"ports"`
		LivenessProbe  *k8sProbe `yaml:"livenessProbe"`
		ReadinessProbe *k8sProbe `yaml:"readinessProbe"`
		StartupProbe   *k8sProbe `yaml:"startupProbe"`
	}
	k8sPodTemplate struct {
		Metadata k8sMeta `yaml:"metadata"`
		Spec     struct {
			Subdomain                     string         `yaml:"subdomain"`
			RestartPolicy                 string         `yaml:"restartPolicy"`
			TerminationGracePeriodSeconds *int           `yaml:"terminationGracePeriodSeconds"`
			ShareProcessNamespace         *bool          `yaml:"shareProcessNamespace"`
			Containers                    []k8sContainer `yaml:"containers"`
		} `yaml:"spec"`
	}
	k8sJob struct {
		Metadata k8sMeta `yaml:"metadata"`
		Spec     struct {
			CompletionMode   string `yaml:"completionMode"`
			Completions      int    `yaml:"completions"`
			Parallelism      int    `yaml:"parallelism"`
			BackoffLimit     *int   `yaml:"backoffLimit"`
			PodFailurePolicy *struct {
				Rules []struct {
					OnExitCodes *struct {
						ContainerName string `yaml:"containerName"`
					} `yaml:"onExitCodes"`
				} `yaml:"rules"`
			} `yaml:"podFailurePolicy"`
			Template k8sPodTemplate `yaml:"template"`
		} `yaml:"spec"`
	}
	k8sPyTorchJob struct {
		Metadata k8sMeta `yaml:"metadata"`
		Spec     struct {
			NprocPerNode  *string `yaml:"nprocPerNode"`
			ElasticPolicy *struct {
				MinReplicas  *int    `yaml:"minReplicas"`
				MaxReplicas  *int    `yaml:"maxReplicas"`
				RdzvBackend  *string `yaml:"rdzvBackend"`
				RdzvHost     *string `yaml:"rdzvHost"`
				RdzvPort     *int    `yaml:"rdzvPort"`
				RdzvID       *string `yaml:"rdzvId"`
				MaxRestarts  *int    `yaml:"maxRestarts"`
				NProcPerNode *int    `yaml:"nProcPerNode"`
				RdzvConf     []struct {
					Key   string `yaml:"key"`
					Value string `yaml:"value"`
				} `yaml:"rdzvConf"`
			} `yaml:"elasticPolicy"`
			PyTorchReplicaSpecs map[string]*struct {
				Replicas      *int           `yaml:"replicas"`
				RestartPolicy string         `yaml:"restartPolicy"`
				Template      k8sPodTemplate `yaml:"template"`
			} `yaml:"pytorchReplicaSpecs"`
		} `yaml:"spec"`
	}
)

// k8sDocs splits a manifest into its documents, keyed by "KIND
// APIVERSION". Each is decoded into the caller's type by decodeDoc.
func k8sDocs(t *testing.T, name string) map[string]*yaml.Node {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(k8sDir, name))
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]*yaml.Node{}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var n yaml.Node
		if err := dec.Decode(&n); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var head struct {
			APIVersion string `yaml:"apiVersion"`
			Kind       string `yaml:"kind"`
		}
		if err := n.Decode(&head); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if head.APIVersion == "" || head.Kind == "" {
			t.Fatalf("%s: a document without apiVersion or kind", name)
		}
		key := head.Kind + " " + head.APIVersion
		if _, dup := docs[key]; dup {
			t.Fatalf("%s: two %s documents", name, key)
		}
		docs[key] = &n
	}
	return docs
}

func decodeDoc[T any](t *testing.T, docs map[string]*yaml.Node, kindVersion string) T {
	t.Helper()
	var v T
	n, ok := docs[kindVersion]
	if !ok {
		t.Fatalf("no %s document", kindVersion)
	}
	if err := n.Decode(&v); err != nil {
		t.Fatalf("%s: %v", kindVersion, err)
	}
	return v
}

// onlyContainer returns the pod's one container.
func onlyContainer(t *testing.T, p k8sPodTemplate) k8sContainer {
	t.Helper()
	if len(p.Spec.Containers) != 1 {
		t.Fatalf("pod template has %d containers, want 1 (gorun as PID 1 of its own container)", len(p.Spec.Containers))
	}
	return p.Spec.Containers[0]
}

// checkGorunCommand: the container's command is gorun itself (so it is
// PID 1 and reaps), not a shell or python wrapping it.
func checkGorunCommand(t *testing.T, c k8sContainer, p k8sPodTemplate) {
	t.Helper()
	if len(c.Command) != 1 || filepath.Base(c.Command[0]) != "gorun" {
		t.Errorf("container %q: command %q, want [gorun]", c.Name, c.Command)
	}
	if c.Image == "" {
		t.Errorf("container %q has no image", c.Name)
	}
	if p.Spec.ShareProcessNamespace != nil && *p.Spec.ShareProcessNamespace {
		t.Error("shareProcessNamespace: gorun would not be PID 1")
	}
}

// k8sVarRef is Kubernetes' $(VAR) reference in command and args.
var k8sVarRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// containerEnv is the container's environment as gorun would see it:
// literal values, a stand-in for each valueFrom, and extra (what an
// operator injects) on top.
func containerEnv(c k8sContainer, extra map[string]string) map[string]string {
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.Value != nil:
			env[e.Name] = *e.Value
		case e.ValueFrom != nil:
			env[e.Name] = "10.0.0.7" // status.podIP and the like
		default:
			env[e.Name] = ""
		}
	}
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// k8sLaunch runs gorun's real CLI on the container's args with its
// environment, the kubelet's $(VAR) expansion applied, and returns the
// Config gorun would run.
func k8sLaunch(t *testing.T, c k8sContainer, env map[string]string) launcher.Config {
	t.Helper()
	cleanEnv(t)
	for k, v := range env {
		t.Setenv(k, v)
	}
	args := make([]string, len(c.Args))
	for i, a := range c.Args {
		args[i] = k8sVarRef.ReplaceAllStringFunc(a, func(ref string) string {
			name := k8sVarRef.FindStringSubmatch(ref)[1]
			v, ok := env[name]
			if !ok {
				t.Errorf("arg %q refers to $(%s), which the container does not define", a, name)
			}
			return v
		})
	}
	return mustLaunch(t, args...)
}

// probePort resolves a probe's port (a number or a container port's name).
func probePort(t *testing.T, c k8sContainer, what string, p *k8sProbe) int {
	t.Helper()
	if p == nil || p.HTTPGet == nil {
		t.Fatalf("container %q: no HTTP %s probe", c.Name, what)
	}
	switch port := p.HTTPGet.Port.(type) {
	case int:
		return port
	case string:
		for _, cp := range c.Ports {
			if cp.Name == port {
				return cp.ContainerPort
			}
		}
		t.Fatalf("container %q: %s probe port %q is not one of its ports", c.Name, what, port)
	}
	t.Fatalf("container %q: %s probe port %v (%T)", c.Name, what, p.HTTPGet.Port, p.HTTPGet.Port)
	return 0
}

// checkProbe: the probe asks gorun's health endpoint for path.
func checkProbe(t *testing.T, c k8sContainer, cfg launcher.Config, what string, p *k8sProbe, path string) {
	t.Helper()
	if cfg.HealthAddr == "" {
		t.Fatalf("container %q has a %s probe but gorun serves no health endpoint", c.Name, what)
	}
	_, port, err := net.SplitHostPort(cfg.HealthAddr)
	if err != nil {
		t.Fatal(err)
	}
	if got := strconv.Itoa(probePort(t, c, what, p)); got != port {
		t.Errorf("container %q: %s probe on port %s, gorun's health endpoint on %s", c.Name, what, got, cfg.HealthAddr)
	}
	if p.HTTPGet.Path != path {
		t.Errorf("container %q: %s probe path %q, want %q", c.Name, what, p.HTTPGet.Path, path)
	}
}

// checkGrace: the kubelet waits longer than gorun's own shutdown, so gorun
// stops its workers (signal, --shutdown-timeout, SIGKILL) and exits before
// the kubelet kills everything.
func checkGrace(t *testing.T, p k8sPodTemplate, cfg launcher.Config) {
	t.Helper()
	g := p.Spec.TerminationGracePeriodSeconds
	if g == nil {
		t.Errorf("no terminationGracePeriodSeconds; the default 30 s is not above a %v shutdown timeout", cfg.ShutdownTimeout)
		return
	}
	if grace := time.Duration(*g) * time.Second; grace <= cfg.ShutdownTimeout {
		t.Errorf("terminationGracePeriodSeconds %d is not above gorun's shutdown timeout %v", *g, cfg.ShutdownTimeout)
	}
}

// hasContainerPort reports whether the container declares port.
func hasContainerPort(c k8sContainer, port int) bool {
	for _, p := range c.Ports {
		if p.ContainerPort == port {
			return true
		}
	}
	return false
}

func TestLaunchK8sIndexedJob(t *testing.T) {
	cfg, _ := checkIndexedJob(t, "indexed-job.yaml")
	if cfg.OnFailure != launcher.OnFailureRestart {
		t.Errorf("--on-failure %q, want restart (indexed-job-heal.yaml is the shrink one)", cfg.OnFailure)
	}
}

// TestLaunchK8sIndexedJobHeal: the shrink-and-heal manifest is the Indexed
// Job with --on-failure=shrink and heal on, a Job that replaces a lost pod
// (its agent is then admitted in the lost pod's place: TestMultiNodeHeal
// runs that flow through the real CLI), and workers that follow the epochs
// (train_elastic.py on gorun_ft.py).
func TestLaunchK8sIndexedJobHeal(t *testing.T) {
	cfg, job := checkIndexedJob(t, "indexed-job-heal.yaml")
	if cfg.OnFailure != launcher.OnFailureShrink || !cfg.Regrow || cfg.MaxRespawns < 1 {
		t.Errorf("--on-failure %q, regrow %v, --max-respawns %d: want shrink, heal on, respawns allowed",
			cfg.OnFailure, cfg.Regrow, cfg.MaxRespawns)
	}
	if b := job.Spec.BackoffLimit; b == nil || *b < 1 {
		t.Errorf("backoffLimit %v: the Job must replace a lost pod", b)
	}
	if cfg.Entrypoint.Program != "/workspace/train_elastic.py" {
		t.Errorf("program %q, want a worker that follows the epochs (train_elastic.py)", cfg.Entrypoint.Program)
	}
}

// checkIndexedJob checks an Indexed Job manifest (a headless Service and the
// Job, gorun as the container command, c10d at pod 0) and returns the Config
// gorun reads from it.
func checkIndexedJob(t *testing.T, name string) (launcher.Config, k8sJob) {
	t.Helper()
	docs := k8sDocs(t, name)
	if len(docs) != 2 {
		t.Fatalf("%s holds %d documents, want a Service and a Job", name, len(docs))
	}
	svc := decodeDoc[k8sService](t, docs, "Service v1")
	job := decodeDoc[k8sJob](t, docs, "Job batch/v1")
	pod := job.Spec.Template
	c := onlyContainer(t, pod)
	checkGorunCommand(t, c, pod)
	cfg := k8sLaunch(t, c, containerEnv(c, nil))

	// The Service gives every pod a DNS name, ready or not.
	if svc.Spec.ClusterIP != "None" {
		t.Errorf("Service clusterIP %q, want None (headless)", svc.Spec.ClusterIP)
	}
	if !svc.Spec.PublishNotReadyAddresses {
		t.Error("Service lacks publishNotReadyAddresses: pods are not ready during rendezvous, so pod 0 would not resolve")
	}
	if pod.Spec.Subdomain != svc.Metadata.Name {
		t.Errorf("pod subdomain %q, want the Service's name %q", pod.Spec.Subdomain, svc.Metadata.Name)
	}
	if len(svc.Spec.Selector) == 0 {
		t.Error("Service has no selector")
	}
	for k, v := range svc.Spec.Selector {
		if pod.Metadata.Labels[k] != v {
			t.Errorf("Service selects %s=%s, pods are labelled %v", k, v, pod.Metadata.Labels)
		}
	}

	// One pod per node, all at once, named by index.
	if job.Spec.CompletionMode != "Indexed" {
		t.Errorf("completionMode %q, want Indexed", job.Spec.CompletionMode)
	}
	if n := job.Spec.Completions; n != cfg.MaxNodes || n != cfg.MinNodes || job.Spec.Parallelism != n {
		t.Errorf("completions %d, parallelism %d, --nnodes %d:%d: want all equal",
			n, job.Spec.Parallelism, cfg.MinNodes, cfg.MaxNodes)
	}
	if p := job.Spec.PodFailurePolicy; p != nil {
		if pod.Spec.RestartPolicy != "Never" {
			t.Errorf("restartPolicy %q: a podFailurePolicy needs Never", pod.Spec.RestartPolicy)
		}
		for _, r := range p.Rules {
			if r.OnExitCodes != nil && r.OnExitCodes.ContainerName != "" && r.OnExitCodes.ContainerName != c.Name {
				t.Errorf("podFailurePolicy names container %q, the container is %q", r.OnExitCodes.ContainerName, c.Name)
			}
		}
	}

	// c10d rendezvous at pod 0, through the Service.
	r := cfg.Rendezvous
	if r.Backend != "c10d" || r.Standalone {
		t.Errorf("rendezvous backend %q standalone %v, want c10d", r.Backend, r.Standalone)
	}
	host, port, err := net.SplitHostPort(r.Endpoint)
	if err != nil {
		t.Fatalf("--rdzv-endpoint %q: %v", r.Endpoint, err)
	}
	if want := job.Metadata.Name + "-0." + svc.Metadata.Name; host != want {
		t.Errorf("--rdzv-endpoint host %q, want pod 0's name %q", host, want)
	}
	if p, _ := strconv.Atoi(port); !hasContainerPort(c, p) {
		t.Errorf("--rdzv-endpoint port %s is not a container port", port)
	}
	if r.RunID != job.Metadata.Name {
		t.Errorf("--rdzv-id %q, want the job's name %q", r.RunID, job.Metadata.Name)
	}
	if r.LocalAddr != "10.0.0.7" {
		t.Errorf("--local-addr %q, want the pod IP", r.LocalAddr)
	}

	checkProbe(t, c, cfg, "liveness", c.LivenessProbe, "/healthz")
	checkProbe(t, c, cfg, "readiness", c.ReadinessProbe, "/readyz")
	if c.StartupProbe != nil {
		checkProbe(t, c, cfg, "startup", c.StartupProbe, "/healthz")
	}
	checkGrace(t, pod, cfg)
	return cfg, job
}

// pytorchJobEnv is what the Kubeflow training operator (v1, elastic mode)
// adds to the container's environment: its elastic env generator
// (pkg/controller.v1/pytorch/elastic.go) plus spec.nprocPerNode
// (envvar.go, training-operator >= 1.8).
func pytorchJobEnv(t *testing.T, job k8sPyTorchJob, c k8sContainer) map[string]string {
	t.Helper()
	ep := job.Spec.ElasticPolicy
	env := map[string]string{"PYTHONUNBUFFERED": "1"}
	host := job.Metadata.Name + "-worker-0"
	if ep.RdzvHost != nil {
		host = *ep.RdzvHost
	}
	port := -1
	if ep.RdzvPort != nil {
		port = *ep.RdzvPort
	} else {
		for _, p := range c.Ports {
			if p.Name == "pytorchjob-port" {
				port = p.ContainerPort
			}
		}
	}
	if port < 0 {
		t.Fatal("no rdzvPort and no container port named pytorchjob-port: the operator cannot build PET_RDZV_ENDPOINT")
	}
	env["PET_RDZV_ENDPOINT"] = fmt.Sprintf("%s:%d", host, port)
	env["PET_RDZV_BACKEND"] = "c10d"
	if ep.RdzvBackend != nil {
		env["PET_RDZV_BACKEND"] = *ep.RdzvBackend
	}
	if ep.MinReplicas != nil && ep.MaxReplicas != nil {
		env["PET_NNODES"] = fmt.Sprintf("%d:%d", *ep.MinReplicas, *ep.MaxReplicas)
	} else {
		env["PET_NNODES"] = strconv.Itoa(*job.Spec.PyTorchReplicaSpecs["Worker"].Replicas)
	}
	if ep.MaxRestarts != nil {
		env["PET_MAX_RESTARTS"] = strconv.Itoa(*ep.MaxRestarts)
	}
	if ep.NProcPerNode != nil {
		env["PET_NPROC_PER_NODE"] = strconv.Itoa(*ep.NProcPerNode)
	}
	if job.Spec.NprocPerNode != nil {
		env["PET_NPROC_PER_NODE"] = *job.Spec.NprocPerNode
	}
	if ep.RdzvID != nil {
		env["PET_RDZV_ID"] = *ep.RdzvID
	}
	if len(ep.RdzvConf) > 0 {
		var kv []string
		for _, c := range ep.RdzvConf {
			kv = append(kv, c.Key+"="+c.Value)
		}
		env["PET_RDZV_CONF"] = strings.Join(kv, ",")
	}
	return env
}

func TestLaunchK8sPyTorchJob(t *testing.T) {
	docs := k8sDocs(t, "pytorchjob.yaml")
	job := decodeDoc[k8sPyTorchJob](t, docs, "PyTorchJob kubeflow.org/v1")
	if len(docs) != 1 {
		t.Fatalf("pytorchjob.yaml holds %d documents, want the PyTorchJob only", len(docs))
	}
	ep := job.Spec.ElasticPolicy
	if ep == nil {
		t.Fatal("no elasticPolicy: without it the operator sets no PET_RDZV_* variables")
	}
	if ep.NProcPerNode != nil && job.Spec.NprocPerNode != nil {
		t.Error("elasticPolicy.nProcPerNode and spec.nprocPerNode together: the operator's webhook refuses that")
	}
	if ep.MinReplicas == nil || ep.MaxReplicas == nil || ep.RdzvID == nil {
		t.Error("elasticPolicy should give minReplicas, maxReplicas and rdzvId (else PET_RDZV_ID is unset and gorun uses \"none\")")
	}
	if _, ok := job.Spec.PyTorchReplicaSpecs["Master"]; ok {
		t.Error("a Master replica: elastic jobs are Workers only (the operator would add MASTER_ADDR, RANK and PET_NODE_RANK)")
	}
	worker := job.Spec.PyTorchReplicaSpecs["Worker"]
	if worker == nil || worker.Replicas == nil {
		t.Fatal("no Worker replicas")
	}
	if n := *worker.Replicas; ep.MinReplicas != nil && ep.MaxReplicas != nil && (n < *ep.MinReplicas || n > *ep.MaxReplicas) {
		t.Errorf("Worker replicas %d outside minReplicas..maxReplicas %d..%d", n, *ep.MinReplicas, *ep.MaxReplicas)
	}
	pod := worker.Template
	c := onlyContainer(t, pod)
	if c.Name != "pytorch" {
		t.Errorf("container %q: the operator configures the container named pytorch", c.Name)
	}
	checkGorunCommand(t, c, pod)
	if len(c.Args) == 0 || strings.HasPrefix(c.Args[0], "-") {
		t.Errorf("args %q: want the program first and no gorun flags (the operator's PET_* configure gorun)", c.Args)
	}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "PET_") {
			t.Errorf("env sets %s by hand; the operator owns PET_*", e.Name)
		}
	}

	opEnv := pytorchJobEnv(t, job, c)
	cfg := k8sLaunch(t, c, containerEnv(c, opEnv))
	r := cfg.Rendezvous
	if r.Backend != "c10d" || r.Endpoint != opEnv["PET_RDZV_ENDPOINT"] || r.RunID != *ep.RdzvID {
		t.Errorf("rendezvous %s %s %s, want c10d %s %s", r.Backend, r.Endpoint, r.RunID, opEnv["PET_RDZV_ENDPOINT"], *ep.RdzvID)
	}
	if want := job.Metadata.Name + "-worker-0:"; !strings.HasPrefix(r.Endpoint, want) {
		t.Errorf("rendezvous endpoint %q, want worker 0's Service %s…", r.Endpoint, want)
	}
	if cfg.MinNodes != *ep.MinReplicas || cfg.MaxNodes != *ep.MaxReplicas {
		t.Errorf("--nnodes %d:%d, want %d:%d from elasticPolicy", cfg.MinNodes, cfg.MaxNodes, *ep.MinReplicas, *ep.MaxReplicas)
	}
	if ep.MaxRestarts != nil && cfg.MaxRestarts != *ep.MaxRestarts {
		t.Errorf("max restarts %d, want %d", cfg.MaxRestarts, *ep.MaxRestarts)
	}
	if cfg.Entrypoint.Program != c.Args[0] {
		t.Errorf("program %q, want %q", cfg.Entrypoint.Program, c.Args[0])
	}

	checkProbe(t, c, cfg, "liveness", c.LivenessProbe, "/healthz")
	// The operator's per-pod headless Services leave out pods that are not
	// ready, and /readyz is 503 during rendezvous: a readiness probe on it
	// would hide worker 0 from the others for ever.
	for what, p := range map[string]*k8sProbe{"readiness": c.ReadinessProbe, "startup": c.StartupProbe} {
		if p != nil && p.HTTPGet != nil && p.HTTPGet.Path == "/readyz" {
			t.Errorf("%s probe on /readyz would deadlock the rendezvous under the operator", what)
		}
	}
	checkGrace(t, pod, cfg)
}
