// Package etcd is gorun's etcd v3 backend:
//
//   - ClientConfig and Connect: reaching a cluster (endpoints, TLS,
//     credentials), waiting for it with progress lines, and failing at
//     once on a certificate or credentials problem;
//   - Storage: a tcpstore.Storage whose keys live in etcd, so a TCPStore
//     server on every node serves one store to PyTorch workers with no
//     single store host (revision-fenced read-modify-writes, watch-released
//     waits, concurrent operations batched into one request);
//   - Store: a rendezvous.Store on a Storage, for the dynamic rendezvous's
//     state;
//   - Liveness: each agent's presence key bound to a lease, and a watch of
//     the others', so that a lost node is seen within about the lease's TTL,
//     on etcd's clock.
package etcd
