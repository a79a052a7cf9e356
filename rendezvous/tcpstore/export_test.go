package tcpstore

import "testing"

// RunServerSuite runs the server tests that hold for every Storage against
// the storages newStorage returns, one fresh storage per server. Each test
// runs once per transport, as on a MemoryStorage.
func RunServerSuite(t *testing.T, newStorage func(t testing.TB) Storage) {
	for _, c := range serverSuite {
		t.Run(c.name, func(t *testing.T) { c.test(t, newStorage) })
	}
}
