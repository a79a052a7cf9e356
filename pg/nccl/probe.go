package nccl

import "fmt"

// probedSymbol is one entry of the symbol table as a library has it.
type probedSymbol struct {
	Name     string
	Optional bool
	Found    bool
}

// ProbeReport is what Probe found in an NCCL library.
type ProbeReport struct {
	// Library is the library as it was asked for.
	Library string
	// Version is ncclGetVersion's answer.
	Version Version
	// Symbols is the number of entry points pg/nccl looks up (required and
	// optional); Found, how many of them the library has.
	Symbols, Found int
	// Missing names the entry points the library lacks.
	Missing []string
	// Shrink, Revoke and Grow: the library has the entry points and is at
	// least the version pg/nccl gates them on (Grow: ncclCommGrow and
	// ncclCommGetUniqueId, NCCL ≥ 2.29; without them Group.Grow falls back
	// to a fresh communicator).
	Shrink, Revoke, Grow bool
	// UniqueID is a unique id ncclGetUniqueId returned (it needs no GPU).
	UniqueID [uniqueIDBytes]byte
}

// String is the probe's one line:
// nccl version=X.Y.Z symbols=N/N shrink=yes|no revoke=yes|no grow=yes|no uniqueid=ok
func (p ProbeReport) String() string {
	return fmt.Sprintf("nccl version=%v symbols=%d/%d shrink=%s revoke=%s grow=%s uniqueid=ok",
		p.Version, p.Found, p.Symbols, yesNo(p.Shrink), yesNo(p.Revoke), yesNo(p.Grow))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// Probe loads an NCCL library (a name dlopen finds or a path; "" is
// Config's default), resolves every entry point pg/nccl uses, and calls
// the two that need no GPU: ncclGetVersion and ncclGetUniqueId. It needs no
// CUDA driver and no device. Errors: a *LoadError when the library cannot
// be loaded or lacks a required entry point, an *Error when a call fails.
func Probe(library string) (ProbeReport, error) {
	if library == "" {
		library = envOr(EnvNCCLLibrary, DefaultNCCLLibrary)
	}
	rep := ProbeReport{Library: library}
	syms, err := probeSymbols(library)
	if err != nil {
		return rep, err
	}
	for _, s := range syms {
		rep.Symbols++
		if s.Found {
			rep.Found++
		} else {
			rep.Missing = append(rep.Missing, s.Name)
		}
	}
	n, err := openNCCL(library)
	if err != nil {
		return rep, err
	}
	code, r := n.getVersion()
	if r != Success {
		return rep, &Error{Op: "ncclGetVersion", Result: r, Text: n.errorString(r)}
	}
	rep.Version = DecodeVersion(code)
	rep.Shrink = rep.Version.AtLeast(VersionShrink) && n.has("ncclCommShrink")
	rep.Revoke = rep.Version.AtLeast(VersionRevoke) && n.has("ncclCommRevoke")
	rep.Grow = rep.Version.AtLeast(VersionGrow) && n.has("ncclCommGrow") && n.has("ncclCommGetUniqueId")
	id, r := n.getUniqueID()
	if r != Success {
		return rep, &Error{Op: "ncclGetUniqueId", Result: r, Text: n.errorString(r), Version: rep.Version}
	}
	if id == (uniqueID{}) {
		return rep, fmt.Errorf("pg/nccl: ncclGetUniqueId of %s returned an all-zero id", library)
	}
	rep.UniqueID = id
	return rep, nil
}
