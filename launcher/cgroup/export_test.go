package cgroup

// SetShell replaces the guard's shell for a test ("" or a missing path
// makes the guard the named program) and returns the old one.
func SetShell(path string) string {
	old := shell
	shell = path
	return old
}
