package control

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// Service is one accepted rule with its stable numeric id (the service_id of
// the inventory API and metric labels).
type Service struct {
	ID        uint32
	Rule      *lbrule.Rule
	CreatedAt time.Time
	UpdatedAt time.Time
	// Status is read-back only (List, Get): whether the rule is in effect.
	// Stages receive only the rules they are asked to apply and ignore it.
	Status RuleStatus
	// CreateBody is the last applied create body, byte for byte, as
	// stored (read-back only; kept for rules that failed to apply too).
	CreateBody []byte
	// Draining holds the addresses (lbrule.Endpoint.Addr) of the
	// endpoints in maintenance: stages give them no new requests or flows
	// and keep everything else about them (KV subscriptions, probes), so
	// they come back warm. Sorted; nil when none.
	Draining []string
}

// EndpointDraining reports whether endpoint i of the rule is draining.
func (s Service) EndpointDraining(i int) bool {
	if len(s.Draining) == 0 || i < 0 || i >= len(s.Rule.Endpoints) {
		return false
	}
	_, found := slices.BinarySearch(s.Draining, s.Rule.Endpoints[i].Addr())
	return found
}

// Reconciler is a stage that makes its own state match the desired services.
// Reconcile receives the complete set every time (not a delta), must be
// idempotent, and must not keep the slice; rules inside are read-only.
type Reconciler interface {
	Name() string
	Reconcile(ctx context.Context, services []Service) error
}

// ErrApply marks a rule that validated but could not be put into effect by a
// stage (for example its VIP:port cannot be bound). A create or update that
// fails so is rolled back.
var ErrApply = errors.New("rule could not be applied")

// Controller owns the rule table.
type Controller struct {
	store    store.Store
	settings lbrule.Settings
	logger   *slog.Logger
	now      func() time.Time

	retryMin, retryMax time.Duration
	m                  *ctlMetrics
	wake               chan struct{} // the retry schedule changed

	mu       sync.Mutex // serializes changes; readers use the snapshot
	services map[uint32]Service
	// invalid holds the stored rules that no longer validate (for example
	// a vLLM rule loaded without LLB_KV_NONE_HASH_SEED): kept, listed with
	// their error, deletable, never handed to a stage.
	invalid map[uint32]error
	status  map[uint32]RuleStatus
	// stored is the fingerprint of each rule's record as last read or
	// written, so Resync applies only what changed.
	stored map[uint32]string
	recs   []Reconciler
}

// New builds a controller over st. settings are the daemon settings rule
// validation depends on (the vLLM seed's launch precondition).
func New(st store.Store, settings lbrule.Settings, logger *slog.Logger, opts ...Option) *Controller {
	if logger == nil {
		logger = slog.Default()
	}
	c := &Controller{store: st, settings: settings, logger: logger, now: time.Now, services: map[uint32]Service{},
		invalid: map[uint32]error{}, status: map[uint32]RuleStatus{}, stored: map[uint32]string{}, wake: make(chan struct{}, 1),
		retryMin: DefaultRetryMin, retryMax: DefaultRetryMax, m: newCtlMetrics()}
	for _, o := range opts {
		o(c)
	}
	if c.retryMin <= 0 {
		c.retryMin = DefaultRetryMin
	}
	c.retryMax = max(c.retryMax, c.retryMin)
	return c
}

// RegisterMetrics registers the controller's metrics (loxilb_rules,
// loxilb_rule_apply_failures_total) with reg.
func (c *Controller) RegisterMetrics(reg prometheus.Registerer) error {
	for _, col := range []prometheus.Collector{c.m.rules, c.m.failures} {
		if err := reg.Register(col); err != nil {
			return fmt.Errorf("register control metrics: %w", err)
		}
	}
	return nil
}

// AddReconciler registers a stage; call before Load.
func (c *Controller) AddReconciler(r Reconciler) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recs = append(c.recs, r)
}

// Load reads the store and applies every rule, each on its own: a rule
// that cannot be applied never holds the others back. A stored rule that
// no longer validates (for example the seed variable was removed from the
// environment) is kept in the table with status failed, listed and
// deletable, but not applied; one that a stage could not apply (its
// VIP:port is held) is failed and retried by Run. The error lists every
// rule that is not in effect.
func (c *Controller) Load(ctx context.Context) error {
	recs, err := c.store.List()
	if err != nil {
		return fmt.Errorf("load rules: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	problems := c.syncLocked(recs)
	c.reconcileLocked(ctx)
	n := 0
	for _, s := range c.snapshotLocked() {
		if s.Status.State == StateApplied {
			n++
			continue
		}
		problems = append(problems, fmt.Errorf("rule %d (%s) %s %s: %s", s.ID, s.Rule.Key(), s.Status.State, s.Status.Reason, s.Status.Message))
	}
	c.logger.Info("rules loaded", "count", len(c.services), "applied", n)
	return errors.Join(problems...)
}

// syncLocked makes the table hold exactly recs: records it already holds
// unchanged (same stored bytes) are left alone, others are read as Load
// reads them, and rules recs lacks are dropped. It does not reconcile; it
// returns the records that cannot be read at all.
func (c *Controller) syncLocked(recs []store.Record) []error {
	var problems []error
	seen := make(map[uint32]bool, len(recs))
	for _, rec := range recs {
		seen[rec.ID] = true
		fp := recordFingerprint(rec)
		if old, ok := c.stored[rec.ID]; ok && old == fp {
			continue
		}
		raw, err := lbrule.Decode(rec.Rule)
		if err != nil {
			// Written by an older build with other field names: read it
			// leniently so it can at least be listed and deleted.
			var lenient lbrule.Rule
			if jerr := json.Unmarshal(rec.Rule, &lenient); jerr != nil {
				problems = append(problems, fmt.Errorf("stored rule %d cannot be read: %w", rec.ID, err))
				c.logger.Error("stored rule cannot be read, not listed", "id", rec.ID, "err", err)
				c.m.failures.WithLabelValues(ReasonInvalid).Inc()
				continue
			}
			raw = &lenient
		}
		svc := Service{ID: rec.ID, Rule: raw, CreatedAt: rec.CreatedAt, UpdatedAt: rec.UpdatedAt, CreateBody: rec.CreateBody,
			Draining: keepDraining(raw, rec.Draining)}
		if err == nil {
			svc.Rule, err = lbrule.Prepare(raw, c.settings)
		}
		delete(c.invalid, rec.ID)
		if err != nil {
			svc.Rule = raw
			c.invalid[rec.ID] = err
		}
		c.services[rec.ID] = svc
		c.stored[rec.ID] = fp
	}
	for id := range c.services {
		if !seen[id] {
			delete(c.services, id)
			delete(c.invalid, id)
			delete(c.stored, id)
		}
	}
	return problems
}

// fingerprint identifies a stored record's content, so a re-read of what
// this node wrote itself changes nothing.
func recordFingerprint(rec store.Record) string {
	return rec.UpdatedAt.UTC().Format(time.RFC3339Nano) + "\x00" + string(rec.Rule) + "\x00" + string(rec.CreateBody) +
		"\x00" + strings.Join(rec.Draining, ",")
}

// Resync re-reads the store and applies what other nodes changed: the
// rules they created or updated are applied here, the ones they deleted
// removed. It holds the table's lock while it reads, so no local write
// interleaves with the read. When the store cannot be read, the table is
// left as it is: the node keeps serving the rules it knows.
func (c *Controller) Resync(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	recs, err := c.store.List()
	if err != nil {
		return fmt.Errorf("resync rules: %w", err)
	}
	before := make(map[uint32]string, len(c.stored))
	for id, fp := range c.stored {
		before[id] = fp
	}
	problems := c.syncLocked(recs)
	added, changed, removed := 0, 0, 0
	for id, fp := range c.stored {
		switch old, ok := before[id]; {
		case !ok:
			added++
		case old != fp:
			changed++
		}
	}
	for id := range before {
		if _, ok := c.stored[id]; !ok {
			removed++
		}
	}
	if added+changed+removed == 0 {
		return errors.Join(problems...)
	}
	c.logger.Info("rules changed in the store", "added", added, "changed", changed, "removed", removed, "count", len(c.services))
	if _, err := c.reconcileLocked(ctx); err != nil {
		problems = append(problems, err)
	}
	return errors.Join(problems...)
}

// Follow keeps the table in step with a store that other nodes write: each
// change the watcher reports is applied by Resync. It returns when ctx
// ends.
func (c *Controller) Follow(ctx context.Context, w store.Watcher) error {
	kick := make(chan struct{}, 1)
	go func() {
		_ = w.Watch(ctx, func() {
			select {
			case kick <- struct{}{}:
			default: // a resync is pending already; it will see this change
			}
		})
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		}
		if err := c.Resync(ctx); err != nil {
			c.logger.Warn("rules from the store not applied", "err", err)
		}
	}
}

// Claims are what no two stored rules may share: the rule's key and, for
// a mode-4 rule, its VIP:port (the proxy has one listener per VIP:port).
// The store refuses a second holder, which settles two nodes creating the
// same rule at once.
func claims(r *lbrule.Rule) []string {
	k := r.Key()
	out := []string{"key/" + k.String()}
	if r.Service.Mode == lbrule.ModeFullProxy {
		out = append(out, fmt.Sprintf("listen/%s:%d", k.IP, r.Service.Port))
	}
	return out
}

// Create validates a rule body and creates or updates the rule with the same
// key. It reports whether a new rule was created. An identical re-post and a
// changed kvEngineType are conflicts.
func (c *Controller) Create(ctx context.Context, body []byte) (Service, bool, error) {
	raw, err := lbrule.Decode(body)
	if err != nil {
		return Service{}, false, err
	}
	r, err := lbrule.Prepare(raw, c.settings)
	if err != nil {
		return Service{}, false, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()

	key := r.Key()
	old, exists := c.findLocked(key)
	if err := c.precheckLocked(ctx, old.ID, r); err != nil { // old.ID is 0 for a new rule
		return Service{}, false, err
	}
	now := c.now().UTC()
	svc := Service{Rule: r, CreatedAt: now, UpdatedAt: now, CreateBody: bytes.Clone(body)}
	oldInvalid := c.invalid[old.ID]
	if exists {
		if old.Rule.Engine() != r.Engine() {
			return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Field: "serviceArguments.kvEngineType",
				Msg: fmt.Sprintf("lbrule-exist error: cant modify rule kv engine type (%s to %s): delete and recreate the rule", old.Rule.Engine(), r.Engine())}
		}
		if sameRule(old.Rule, r) {
			return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Reason: ReasonDuplicate,
				Msg: fmt.Sprintf("lbrule-exists error: rule %s already exists with the same configuration", key)}
		}
		svc.ID, svc.CreatedAt = old.ID, old.CreatedAt
		// An update keeps the maintenance state of the endpoints it keeps.
		svc.Draining = keepDraining(r, old.Draining)
	} else {
		id, err := c.store.NextID()
		if err != nil {
			return Service{}, false, fmt.Errorf("allocate rule id: %w", err)
		}
		svc.ID = id
	}

	if other, ok := c.listenerTakenLocked(svc.ID, r); ok {
		return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Field: "serviceArguments.block", Reason: ReasonDuplicate,
			Msg: fmt.Sprintf("mode-4 rule %d (%s) already listens on %s:%d: the proxy tells rules apart by address, not by block mark; use another VIP or port",
				other.ID, other.Rule.Key(), r.Service.ExternalIP, r.Service.Port)}
	}
	stageFailing := false
	for _, st := range c.status {
		stageFailing = stageFailing || st.Reason == ReasonStageFailed
	}
	c.services[svc.ID] = svc
	delete(c.invalid, svc.ID)
	failures, stageErr := c.reconcileLocked(ctx)
	// Only this rule's own failure, or a stage that starts failing as a
	// whole with it, refuses the change: rules that were failing before
	// stay failed and retried, and do not hold every later change back.
	err = nil
	if re := failures[svc.ID]; re != nil && !re.Degraded {
		err = fmt.Errorf("%w: %w", ErrApply, re)
	} else if stageErr != nil && !stageFailing {
		err = fmt.Errorf("%w: %w", ErrApply, stageErr)
	}
	// rollback restores the previous table so stages and store agree again.
	rollback := func() {
		if exists {
			c.services[svc.ID] = old
			if oldInvalid != nil {
				c.invalid[svc.ID] = oldInvalid
			}
		} else {
			delete(c.services, svc.ID)
		}
		if _, rbErr := c.reconcileLocked(ctx); rbErr != nil {
			c.logger.Error("rollback reconcile failed", "err", rbErr)
		}
	}
	if err != nil {
		rollback()
		return Service{}, false, err
	}
	rb, err := lbrule.Encode(r)
	if err != nil {
		return Service{}, false, err
	}
	rec := store.Record{ID: svc.ID, Rule: rb, CreateBody: svc.CreateBody, Draining: svc.Draining, CreatedAt: svc.CreatedAt, UpdatedAt: svc.UpdatedAt}
	if err := c.store.Put(rec, claims(r)...); err != nil {
		rollback()
		var ce *store.ClaimError
		if errors.As(err, &ce) {
			// Another node created the same rule (or VIP:port) first; the
			// watch brings its rule here.
			return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Reason: ReasonDuplicate,
				Msg: fmt.Sprintf("lbrule-exists error: rule %s: another node stored a rule that holds the same key or VIP:port first (%v); it is applied on every node", key, ce)}
		}
		return Service{}, false, fmt.Errorf("persist rule %d: %w", svc.ID, err)
	}
	c.stored[svc.ID] = recordFingerprint(rec)
	c.logger.Info("rule applied", "id", svc.ID, "key", key.String(), "mode", r.Service.Mode, "engine", r.Engine(), "update", exists)
	svc.Status = c.status[svc.ID]
	return svc, !exists, nil
}

func sameRule(a, b *lbrule.Rule) bool {
	x, _ := lbrule.Encode(a)
	y, _ := lbrule.Encode(b)
	return bytes.Equal(x, y)
}

// listenerTakenLocked finds another mode-4 rule on the same VIP:port (they
// differ by block mark only): the proxy has one listener per VIP:port, so
// the second could never be served. Rules that are not in effect count:
// a VIP:port is never stored twice.
func (c *Controller) listenerTakenLocked(id uint32, r *lbrule.Rule) (Service, bool) {
	if r.Service.Mode != lbrule.ModeFullProxy {
		return Service{}, false
	}
	for _, s := range c.services {
		o := s.Rule.Service
		if s.ID != id && o.Mode == lbrule.ModeFullProxy && o.Port == r.Service.Port && s.Rule.Key().IP == r.Key().IP {
			return s, true
		}
	}
	return Service{}, false
}

// findLocked returns the rule with key k; of stored duplicates, the one
// with the lowest id (the one applied).
func (c *Controller) findLocked(k lbrule.Key) (Service, bool) {
	var found Service
	ok := false
	for _, s := range c.services {
		if s.Rule.Key() == k && (!ok || s.ID < found.ID) {
			found, ok = s, true
		}
	}
	return found, ok
}

// Delete removes the rule with key k, whatever its status. A store that
// holds the key twice (written by an older build) loses every copy.
func (c *Controller) Delete(ctx context.Context, k lbrule.Key) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var victims []Service
	for _, s := range c.snapshotLocked() {
		if s.Rule.Key() == k {
			victims = append(victims, s)
		}
	}
	if len(victims) == 0 {
		return &lbrule.RuleError{Class: lbrule.ErrNotFound, Msg: fmt.Sprintf("lbrule not-exists error: no rule %s", k)}
	}
	return c.deleteLocked(ctx, victims)
}

// DeleteByName removes every rule with that name and reports how many.
func (c *Controller) DeleteByName(ctx context.Context, name string) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var victims []Service
	for _, s := range c.services {
		if s.Rule.Service.Name == name {
			victims = append(victims, s)
		}
	}
	if len(victims) == 0 {
		return 0, &lbrule.RuleError{Class: lbrule.ErrNotFound, Msg: fmt.Sprintf("lbrule not-exists error: no rule named %q", name)}
	}
	return len(victims), c.deleteLocked(ctx, victims)
}

func (c *Controller) deleteLocked(ctx context.Context, victims []Service) error {
	for _, s := range victims {
		if err := c.store.Delete(s.ID); err != nil {
			return fmt.Errorf("delete rule %d from store: %w", s.ID, err)
		}
		delete(c.services, s.ID)
		delete(c.invalid, s.ID)
		delete(c.stored, s.ID)
		c.logger.Info("rule deleted", "id", s.ID, "key", s.Rule.Key().String())
	}
	if _, err := c.reconcileLocked(ctx); err != nil {
		c.logger.Error("reconcile after delete", "err", err)
		return fmt.Errorf("%w: %w", ErrApply, err)
	}
	return nil
}

// List returns the services ordered by id.
func (c *Controller) List() []Service {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.snapshotLocked()
}

// Get returns one service by id.
func (c *Controller) Get(id uint32) (Service, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.services[id]
	s.Status = c.status[id]
	return s, ok
}

func (c *Controller) snapshotLocked() []Service {
	out := make([]Service, 0, len(c.services))
	for _, s := range c.services {
		s.Status = c.status[s.ID]
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// reconcileLocked hands every rule that can be applied to every stage and
// records each rule's status. Invalid rules, and a rule whose key (or
// mode-4 VIP:port) an older rule already holds, are not handed over. It
// returns the first failure each stage reported per rule, and what the
// stages reported without naming a rule.
func (c *Controller) reconcileLocked(ctx context.Context) (map[uint32]*RuleError, error) {
	all := c.snapshotLocked()
	desired := make([]Service, 0, len(all))
	blocked := map[uint32]*RuleError{}
	keys := map[lbrule.Key]uint32{}
	listeners := map[string]uint32{}
	for _, s := range all {
		if err := c.invalid[s.ID]; err != nil {
			blocked[s.ID] = &RuleError{ID: s.ID, Reason: reasonOf(err, ReasonInvalid), Err: fmt.Errorf("stored rule does not validate: %w", err)}
			continue
		}
		k := s.Rule.Key()
		if first, ok := keys[k]; ok {
			blocked[s.ID] = &RuleError{ID: s.ID, Reason: ReasonDuplicate,
				Err: fmt.Errorf("rule %d already holds %s; delete the rule and create it again", first, k)}
			continue
		}
		if s.Rule.Service.Mode == lbrule.ModeFullProxy {
			l := fmt.Sprintf("%s:%d", k.IP, s.Rule.Service.Port)
			if first, ok := listeners[l]; ok {
				blocked[s.ID] = &RuleError{ID: s.ID, Reason: ReasonDuplicate,
					Err: fmt.Errorf("mode-4 rule %d already listens on %s", first, l)}
				continue
			}
			listeners[l] = s.ID
		}
		keys[k] = s.ID
		desired = append(desired, s)
	}
	failures := map[uint32]*RuleError{}
	var errs []error
	for _, r := range c.recs {
		rules, rest := splitRuleErrors(r.Reconcile(ctx, desired))
		for _, re := range rules {
			if prev, ok := failures[re.ID]; ok && (!prev.Degraded || re.Degraded) {
				continue // the first failure that stops the rule serving wins
			}
			failures[re.ID] = &RuleError{ID: re.ID, Reason: reasonOf(re, ReasonStageFailed), Degraded: re.Degraded,
				Err: fmt.Errorf("%s: %w", r.Name(), re.Err)}
		}
		if rest != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Name(), rest))
		}
	}
	stageErr := errors.Join(errs...)
	c.updateStatusLocked(blocked, failures, stageErr)
	return failures, stageErr
}
