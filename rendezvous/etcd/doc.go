// Package etcd is gorun's etcd v3 backend: a tcpstore.Storage whose keys
// live in etcd, so a TCPStore server on every node serves one store to
// PyTorch workers with no single store host (Storage), and the dynamic
// rendezvous's state kept in etcd with revision-fenced transactions, agent
// liveness through leases and waits through watches.
package etcd
