// Package launcher is gorun's elastic agent: one per node, it takes a
// Config (what torchrun's command line says), rendezvouses with the other
// agents, starts one worker per local rank with torchrun's environment,
// supervises them, and restarts or stops the group as torchrun would — or,
// under --on-failure shrink, lets the survivors carry on.
//
// Its parts, by file:
//
//   - config.go: the typed configuration, its defaults and Validate;
//     cmd/gorun turns flags and PET_* variables into a Config with the
//     parsers here and in signals.go, nproc.go and endpoint.go;
//     rdzv_settings.go: --rdzv-conf and the rendezvous flags, parsed once.
//   - agent.go: Run and the agent's loop: rendezvous, run a round,
//     decide (the next round, a restart, or the end); stop.go: the one
//     path from a stop signal to every wait; waitnotice.go: long waits
//     saying what they wait for.
//   - round.go: a round's mechanism: starting the workers, and the one
//     loop that turns what happens while they run into events.
//   - restart_mode.go, shrink_mode.go: the two failure policies, each a
//     loop over a round's events; shrink mode heals (respawns lost local
//     ranks, admits replacement nodes) with regrow.go's respawn policy.
//   - membership.go, dynamic.go, etcd.go: how an agent learns its place
//     in the job (one node; the dynamic rendezvous over c10d or static;
//     over etcd); jobnode.go: what the two multi-node memberships share
//     (the rendezvous handle, the job's restart count, outcome and exit
//     barrier, the admission of a node in a lost node's place).
//   - survivors.go: shrink mode's agreement, the agent's side.
//   - group.go, output.go, prefix.go, failure.go, env.go: the worker
//     processes, their output (console prefixes, filtered logs), their
//     failures, their environment.
//   - health.go: the HTTP endpoint (/healthz, /readyz, /metrics);
//     gossip.go: node liveness (package health) among the agents.
package launcher
