package health_test

import (
	"context"
	"log"
	"time"

	"github.com/gorunhq/gorun/health"
)

// How an agent wires node liveness into a rendezvous round: publish Addr in
// its record, join the addresses the round published, name the round's
// agents, and watch events beside the heartbeat Monitor's.
func ExampleStartNodes() {
	cfg := health.DefaultNodeConfig()
	cfg.Name = "agent-3"           // the agent's rendezvous identity
	cfg.Cluster = "run-42"         // the job's run ID
	cfg.AdvertiseAddr = "10.0.0.3" // the address the agent publishes
	nodes, err := health.StartNodes(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer nodes.Close()
	_ = nodes.Addr() // → this agent's rendezvous record

	// After the round: every agent's name and gossip address.
	round := map[string]string{"agent-1": "10.0.0.1:7946", "agent-2": "10.0.0.2:7946", "agent-3": nodes.Addr()}
	var names, seeds []string
	for name, addr := range round {
		names, seeds = append(names, name), append(seeds, addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := nodes.Join(ctx, seeds); err != nil {
		log.Fatal(err) // errors.Is(err, health.ErrNoSeedReached): none of them answered
	}
	nodes.Expect(names)

	events := make(chan health.Event, 16) // shared with Monitor.Run
	go nodes.Run(ctx, events)
	for {
		select {
		case ev := <-events:
			switch ev.Kind {
			case health.NodeDead:
				log.Printf("lost %s: %v", ev.Node, ev) // shrink or restart
			case health.NodeLeft, health.NodeJoined:
				log.Print(ev)
			}
		case <-ctx.Done():
			// A clean exit: tell the peers, then stop (Close, deferred).
			nodes.Leave(time.Second)
			return
		}
	}
}
