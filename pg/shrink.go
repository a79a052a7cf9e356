package pg

import (
	"fmt"
	"slices"
)

// ShrinkFlags are NCCL's ncclCommShrink flags, which PyTorch's shrink_group
// passes through.
type ShrinkFlags int

const (
	// ShrinkDefault shrinks an idle group (NCCL_SHRINK_DEFAULT).
	ShrinkDefault ShrinkFlags = 0
	// ShrinkAbort first terminates the group's ongoing operations, then
	// shrinks it (NCCL_SHRINK_ABORT): what survivors use when a peer died
	// mid-collective.
	ShrinkAbort ShrinkFlags = 1
)

func (f ShrinkFlags) String() string {
	switch f {
	case ShrinkDefault:
		return "default"
	case ShrinkAbort:
		return "abort"
	}
	return fmt.Sprintf("ShrinkFlags(%d)", int(f))
}

// ValidateShrink checks a Shrink call by rank of a group of size, in the
// order and with the messages of PyTorch's shrink_group: empty list, flags,
// group size, each element (bounds, duplicates), everyone excluded, the
// caller excluded. Errors wrap ErrInvalidArgument.
func ValidateShrink(rank, size int, exclude []int, flags ShrinkFlags) error {
	if len(exclude) == 0 {
		return invalidf("ranks_to_exclude cannot be empty. To shrink a group, you must specify at least one rank to exclude. Example: [failed_rank_id]")
	}
	if flags != ShrinkDefault && flags != ShrinkAbort {
		return invalidf("Invalid shrink_flags value: %d. Must be one of: SHRINK_DEFAULT (0) or SHRINK_ABORT (1). Use SHRINK_ABORT to abort ongoing operations before shrinking.", int(flags))
	}
	if size <= 1 {
		return invalidf("Cannot shrink a process group with size %d. Group must have at least 2 ranks to support shrinking.", size)
	}
	seen := make(map[int]bool, len(exclude))
	for i, r := range exclude {
		if r < 0 || r >= size {
			return invalidf("Rank %d at index %d is out of bounds for group size %d. Valid ranks are in range [0, %d].", r, i, size, size-1)
		}
		if seen[r] {
			return invalidf("Duplicate rank %d found in ranks_to_exclude at index %d. Each rank can only be excluded once.", r, i)
		}
		seen[r] = true
	}
	if len(exclude) >= size {
		return invalidf("Cannot exclude all %d ranks from process group. At least one rank must remain. Excluding %d ranks.", size, len(exclude))
	}
	if seen[rank] {
		return invalidf("Current rank %d is in the exclusion list and should not call shrink_group(). Only non-excluded ranks should participate in the shrinking operation. Excluded ranks should terminate their processes instead.", rank)
	}
	return nil
}

// Survivors returns, for a group of size with the ranks in exclude removed,
// the new rank of every old rank: dense, in the old order, -1 for an
// excluded rank. It is the renumbering every backend's Shrink must use
// (PyTorch: {global: new for new, global in enumerate(remaining)}). It
// assumes a valid exclude list.
func Survivors(size int, exclude []int) []int {
	newRank := make([]int, size)
	next := 0
	for old := range size {
		if slices.Contains(exclude, old) {
			newRank[old] = -1
			continue
		}
		newRank[old] = next
		next++
	}
	return newRank
}
