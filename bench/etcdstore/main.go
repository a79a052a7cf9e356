// Command etcdstore serves c10d's TCPStore protocol from gorun's tcpstore
// server with its keys in etcd (rendezvous/etcd.Storage), for benchmarking
// the etcd-backed worker store with bench/storeload:
//
//	etcdstore -etcd 127.0.0.1:2379 -listen 127.0.0.1:0 -prefix /bench/1/
//
// It prints the address it serves on stdout and runs until SIGTERM/SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

func main() {
	endpoints := flag.String("etcd", "127.0.0.1:2379", "etcd endpoints, comma-separated")
	listen := flag.String("listen", "127.0.0.1:0", "address to serve the TCPStore protocol on")
	prefix := flag.String("prefix", "/gorun-bench/", "etcd key prefix of the store")
	flag.Parse()
	if err := run(strings.Split(*endpoints, ","), *listen, *prefix); err != nil {
		fmt.Fprintln(os.Stderr, "etcdstore:", err)
		os.Exit(1)
	}
}

func run(endpoints []string, listen, prefix string) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix})
	cancel()
	if err != nil {
		return err
	}
	defer st.Close()
	// Storage calls block on etcd: a goroutine per connection, not the
	// event loops, so one connection's round trip holds up no other.
	srv, err := tcpstore.Listen(listen, tcpstore.ServerConfig{Storage: st, GoroutinePerConn: true})
	if err != nil {
		return err
	}
	defer srv.Close()
	fmt.Println(srv.Addr())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	return nil
}
