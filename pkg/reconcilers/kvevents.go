package reconcilers

import (
	"context"
	"fmt"
	"strconv"
	"sync"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
)

// Subscriptions is the KV-event manager (*kvevents.Manager).
type Subscriptions interface {
	Sync(specs []kvevents.Spec) error
}

// Inventories is the part of kvindex a rule removal touches.
type Inventories interface {
	DropService(service uint32)
}

// KVEvents keeps KV-event subscriptions and inventories in step with
// the KV-exact rules: prefill endpoints for kvExactMode 1, every endpoint
// for 3. An endpoint list change restarts that endpoint's subscription, and
// a removed rule's inventories are dropped.
type KVEvents struct {
	Subs Subscriptions
	Inv  Inventories
	Seed string // LLB_KV_NONE_HASH_SEED

	mu   sync.Mutex
	prev map[uint32][]string // service -> endpoint identities, to drop stale inventories
}

// Name implements control.Reconciler.
func (k *KVEvents) Name() string { return "kv-events" }

// Reconcile implements control.Reconciler.
func (k *KVEvents) Reconcile(_ context.Context, services []control.Service) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var specs []kvevents.Spec
	next := map[uint32][]string{}
	for _, s := range services {
		r := s.Rule
		var ids []string
		for _, ep := range r.Endpoints {
			ids = append(ids, ep.IP+":"+strconv.Itoa(ep.Port))
		}
		next[s.ID] = ids
		for _, i := range r.SubscribedEndpoints() {
			ep := r.Endpoints[i]
			name := r.Service.Name
			if name == "" {
				name = strconv.FormatUint(uint64(s.ID), 10)
			}
			specs = append(specs, kvevents.Spec{Service: s.ID, ServiceName: name, EPIdx: i, Engine: r.Engine(), Host: ep.IP,
				TargetPort: ep.Port, ZmqPort: r.Service.KVZmqPort, Ranks: r.Service.KVDpRankCount, HashAlgo: r.Service.KVHashAlgo,
				BlockSize: r.Service.KVBlockSize, Seed: k.Seed})
		}
	}
	if err := k.Subs.Sync(specs); err != nil {
		return fmt.Errorf("kv subscriptions: %w", err)
	}
	for id, ids := range k.prev {
		// A removed rule, or a rule whose endpoints changed (indexes now
		// mean other hosts): its inventories no longer describe anything.
		if now, ok := next[id]; !ok || fmt.Sprint(now) != fmt.Sprint(ids) {
			k.Inv.DropService(id)
		}
	}
	k.prev = next
	return nil
}

var _ control.Reconciler = (*KVEvents)(nil)
