package rendezvous

import (
	"context"
	"strings"
)

// PrefixStore namespaces another Store the way c10d's PrefixStore does: key k
// becomes prefix + "/" + k. Nesting composes outward in: a PrefixStore "a"
// over a PrefixStore "b" maps k to "b/a/k". NumKeys is not filtered (c10d
// delegates it too); ListKeys keeps only this prefix's keys and strips it.
//
// Closing a PrefixStore does nothing: the underlying store belongs to whoever
// created it.
type PrefixStore struct {
	prefix string // with the trailing "/"
	under  Store
}

var _ Store = (*PrefixStore)(nil)

// NewPrefixStore returns a view of s under prefix.
func NewPrefixStore(prefix string, s Store) *PrefixStore {
	return &PrefixStore{prefix: prefix + "/", under: s}
}

// Prefix returns the prefix as given to NewPrefixStore.
func (p *PrefixStore) Prefix() string { return strings.TrimSuffix(p.prefix, "/") }

// Underlying returns the wrapped store.
func (p *PrefixStore) Underlying() Store { return p.under }

// Key returns the key the underlying store sees for k.
func (p *PrefixStore) Key(k string) string { return p.prefix + k }

func (p *PrefixStore) keys(ks []string) []string {
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = p.prefix + k
	}
	return out
}

func (p *PrefixStore) Set(ctx context.Context, key string, value []byte) error {
	return p.under.Set(ctx, p.Key(key), value)
}

func (p *PrefixStore) Get(ctx context.Context, key string) ([]byte, error) {
	return p.under.Get(ctx, p.Key(key))
}

func (p *PrefixStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	return p.under.Add(ctx, p.Key(key), delta)
}

func (p *PrefixStore) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	return p.under.CompareSet(ctx, p.Key(key), expected, desired)
}

func (p *PrefixStore) Wait(ctx context.Context, keys ...string) error {
	return p.under.Wait(ctx, p.keys(keys)...)
}

func (p *PrefixStore) Check(ctx context.Context, keys ...string) (bool, error) {
	return p.under.Check(ctx, p.keys(keys)...)
}

func (p *PrefixStore) Delete(ctx context.Context, key string) (bool, error) {
	return p.under.Delete(ctx, p.Key(key))
}

func (p *PrefixStore) NumKeys(ctx context.Context) (int64, error) {
	return p.under.NumKeys(ctx)
}

func (p *PrefixStore) Append(ctx context.Context, key string, value []byte) error {
	return p.under.Append(ctx, p.Key(key), value)
}

func (p *PrefixStore) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	return p.under.MultiGet(ctx, p.keys(keys)...)
}

func (p *PrefixStore) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	return p.under.MultiSet(ctx, p.keys(keys), values)
}

func (p *PrefixStore) ListKeys(ctx context.Context) ([]string, error) {
	all, err := p.under.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, k := range all {
		if rest, ok := strings.CutPrefix(k, p.prefix); ok {
			out = append(out, rest)
		}
	}
	return out, nil
}

func (p *PrefixStore) QueuePush(ctx context.Context, key string, value []byte) error {
	return p.under.QueuePush(ctx, p.Key(key), value)
}

func (p *PrefixStore) QueuePop(ctx context.Context, key string, block bool) ([]byte, error) {
	return p.under.QueuePop(ctx, p.Key(key), block)
}

func (p *PrefixStore) QueueLen(ctx context.Context, key string) (int64, error) {
	return p.under.QueueLen(ctx, p.Key(key))
}

func (p *PrefixStore) Barrier(ctx context.Context, key string, worldSize int64) error {
	return p.under.Barrier(ctx, p.Key(key), worldSize)
}

// Close does nothing; see the type's documentation.
func (p *PrefixStore) Close() error { return nil }
