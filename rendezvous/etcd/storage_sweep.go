package etcd

import (
	"context"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Orphan chunks. A writer that dies between a large value's chunks and its
// head leaves a generation no head names. Its mark in flight (m/w/…, under
// the writer's lease) lapses WriteLeaseTTL after the writer's last renewal;
// from then on a sweep deletes the generation. Sweeps run when a Storage
// starts (an agent restarted after its death, a replacement node) and,
// for one key, after each large write of that key. A sweep is one range
// request when there are no chunks, so every node may run one.

// maxStartSweeps bounds how many times a starting Storage sweeps again
// while it finds generations of others marked in flight: a writer that
// died just before it started holds its mark until its lease lapses.
const maxStartSweeps = 4

// sweepLoop sweeps the store's orphan chunks when the Storage starts, and
// again a lease's lifetime later while generations are marked in flight.
func (s *Storage) sweepLoop() {
	defer s.loops.Done()
	for range maxStartSweeps {
		ctx, cancel := s.opCtx()
		marked, err := s.sweep(ctx, s.prefix+chunksDir)
		cancel()
		if err != nil && s.ctx.Err() == nil {
			s.log.Debug("etcd storage: sweeping orphan chunks", zap.String("prefix", s.prefix), zap.Error(err))
		}
		if err != nil || marked == 0 {
			return
		}
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(s.leaseTTL + time.Second):
		}
	}
}

// sweep deletes the generations of chunks under dir (every key's, or one
// key's chunkDir) that no head names and no mark protects, and returns how
// many generations it left for their marks.
//
// Why it is safe: the chunks and the marks are read at one revision, and a
// writer marks a generation before its first chunk, so an unmarked
// generation there is one whose writer has named it in a head, dropped it,
// or stopped renewing its mark. Each key's deletion is fenced on the mod
// revision its head was read at: a head written since (the generation's
// own, by a writer late but alive) keeps the generation, and a head that
// names a deleted generation is refused by its own fence (headWrite).
func (s *Storage) sweep(ctx context.Context, dir string) (marked int, err error) {
	chunks := s.prefix + chunksDir
	marks := s.prefix + writesDir + strings.TrimPrefix(dir, chunks)
	var resp *clientv3.TxnResponse
	err = s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Txn(ctx).Then(
			clientv3.OpGet(dir, clientv3.WithPrefix(), clientv3.WithKeysOnly()),
			clientv3.OpGet(marks, clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		).Commit()
		return err
	})
	if err != nil {
		return 0, err
	}
	gens := map[string]map[string]bool{} // hex(k) → generation → marked
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		hexK, rest, _ := strings.Cut(strings.TrimPrefix(string(kv.Key), chunks), "/")
		gen, _, _ := strings.Cut(rest, "/")
		if gens[hexK] == nil {
			gens[hexK] = map[string]bool{}
		}
		gens[hexK][gen] = false
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		hexK, gen, _ := strings.Cut(strings.TrimPrefix(string(kv.Key), s.prefix+writesDir), "/")
		if _, ok := gens[hexK][gen]; ok {
			gens[hexK][gen] = true
			marked++
		}
	}
	for hexK, gs := range gens {
		name, err := hexDecode(hexK)
		if err != nil {
			continue // not a chunk of this Storage's making
		}
		if err := s.sweepKey(ctx, s.prefix+name, gs); err != nil {
			return marked, err
		}
	}
	return marked, nil
}

// sweepKey deletes the unmarked generations of etcd key k's chunks in gens
// that k's head does not name, fenced on the head's mod revision.
func (s *Storage) sweepKey(ctx context.Context, k string, gens map[string]bool) error {
	r, err := s.get(ctx, k)
	if err != nil {
		return err
	}
	var named string
	var modRev int64
	if len(r.Kvs) > 0 {
		modRev = r.Kvs[0].ModRevision
		if h, ok := parseHead(r.Kvs[0].Value); ok {
			named = h.gen
		}
	}
	var ops []clientv3.Op
	for gen, marked := range gens {
		if !marked && gen != named {
			ops = append(ops, clientv3.OpDelete(s.chunkDir(k)+gen+"/", clientv3.WithPrefix()))
		}
	}
	// etcd bounds a transaction's operations (--max-txn-ops, 128).
	for len(ops) > 0 {
		n := min(len(ops), popBatchMax)
		err := s.retry(ctx, func(ctx context.Context) error {
			_, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", modRev)).Then(ops[:n]...).Commit()
			return err
		})
		if err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}
