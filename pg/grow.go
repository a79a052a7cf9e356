package pg

import "context"

// Grower is a ProcessGroup that can grow: heal's second half, after a
// Shrink. Backends that can take newcomers into a running group implement
// it (pg/cpu; pg/nccl with ncclCommGrow, NCCL 2.29 and later).
type Grower interface {
	ProcessGroup
	// Grow returns a new group of this group's ranks plus spec.Added
	// newcomers: every member keeps its rank, the newcomers take ranks
	// Size() to Size()+spec.Added-1. With no newcomers (Added 0) it
	// re-forms the members in a fresh group: how they go on after an
	// aborted grow that did not complete, their group aborted with it. Every member calls it with the same
	// spec; each newcomer joins through its backend's JoinGrow with the same
	// spec and its rank in the new group. Members and newcomers meet under
	// spec.Namespace (the same store as this group), which must be new to
	// that store.
	//
	// The group must be idle. It is left usable: a grow that does not
	// complete (a newcomer never comes, within ctx and the group's
	// timeout) returns an error and the members carry on with the group
	// they have; survivors never wait on a newcomer without bound. Once the
	// new group is in use, Close the old one.
	Grow(ctx context.Context, spec GrowSpec) (ProcessGroup, error)
}

// GrowSpec says how a group grows.
type GrowSpec struct {
	// Added is the number of newcomers; 0 re-forms the members.
	Added int
	// Namespace is where members and newcomers meet in the store: agreed
	// by all of them beforehand (e.g. named after the epoch that decided
	// the grow), and never used before.
	Namespace string
}

// ValidateGrow checks a Grow call on a group of size. Errors wrap
// ErrInvalidArgument.
func ValidateGrow(size int, spec GrowSpec) error {
	switch {
	case spec.Added < 0:
		return invalidf("grow: %d newcomers; want 0 or more", spec.Added)
	case spec.Namespace == "":
		return invalidf("grow: no namespace for members and newcomers to meet in")
	case size+spec.Added < size:
		return invalidf("grow: %d newcomers overflow a group of %d", spec.Added, size)
	}
	return nil
}
