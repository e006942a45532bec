package control

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

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
}

// Reconciler is a stage that makes its own state match the desired services.
// Reconcile receives the complete set every time (not a delta), must be
// idempotent, and must not keep the slice; rules inside are read-only.
type Reconciler interface {
	Name() string
	Reconcile(ctx context.Context, services []Service) error
}

// ErrApply marks a rule that validated but could not be put into effect by a
// stage (for example its VIP:port cannot be bound). The rule is rolled back.
var ErrApply = errors.New("rule could not be applied")

// Controller owns the rule table.
type Controller struct {
	store  store.Store
	env    lbrule.LookupEnv
	logger *slog.Logger
	now    func() time.Time

	mu       sync.Mutex // serializes changes; readers use the snapshot
	services map[uint32]Service
	recs     []Reconciler
}

// New builds a controller over st. env is the environment lookup used for
// launch preconditions (os.LookupEnv in the daemon).
func New(st store.Store, env lbrule.LookupEnv, logger *slog.Logger) *Controller {
	if logger == nil {
		logger = slog.Default()
	}
	return &Controller{store: st, env: env, logger: logger, now: time.Now, services: map[uint32]Service{}}
}

// AddReconciler registers a stage; call before Load.
func (c *Controller) AddReconciler(r Reconciler) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recs = append(c.recs, r)
}

// Load reads the store and applies every rule. A stored rule that no longer
// validates (for example the seed variable was removed from the environment)
// is kept in the store, reported, and not applied: it is never dropped
// silently, and the error lists every such rule.
func (c *Controller) Load(ctx context.Context) error {
	recs, err := c.store.List()
	if err != nil {
		return fmt.Errorf("load rules: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var problems []error
	for _, rec := range recs {
		r, err := lbrule.Decode(rec.Rule)
		if err == nil {
			r, err = lbrule.Prepare(r, c.env)
		}
		if err != nil {
			problems = append(problems, fmt.Errorf("stored rule %d not applied: %w", rec.ID, err))
			c.logger.Error("stored rule not applied", "id", rec.ID, "err", err)
			continue
		}
		c.services[rec.ID] = Service{ID: rec.ID, Rule: r, CreatedAt: rec.CreatedAt, UpdatedAt: rec.UpdatedAt}
	}
	if err := c.reconcileLocked(ctx); err != nil {
		problems = append(problems, err)
	}
	c.logger.Info("rules loaded", "count", len(c.services))
	return errors.Join(problems...)
}

// Create validates a rule body and creates or updates the rule with the same
// key. It reports whether a new rule was created. An identical re-post and a
// changed kvEngineType are conflicts.
func (c *Controller) Create(ctx context.Context, body []byte) (Service, bool, error) {
	raw, err := lbrule.Decode(body)
	if err != nil {
		return Service{}, false, err
	}
	r, err := lbrule.Prepare(raw, c.env)
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
	svc := Service{Rule: r, CreatedAt: now, UpdatedAt: now}
	if exists {
		if old.Rule.Engine() != r.Engine() {
			return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Field: "serviceArguments.kvEngineType",
				Msg: fmt.Sprintf("lbrule-exist error: cant modify rule kv engine type (%s to %s): delete and recreate the rule", old.Rule.Engine(), r.Engine())}
		}
		if sameRule(old.Rule, r) {
			return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict,
				Msg: fmt.Sprintf("lbrule-exists error: rule %s already exists with the same configuration", key)}
		}
		svc.ID, svc.CreatedAt = old.ID, old.CreatedAt
	} else {
		id, err := c.store.NextID()
		if err != nil {
			return Service{}, false, fmt.Errorf("allocate rule id: %w", err)
		}
		svc.ID = id
	}

	if other, ok := c.listenerTakenLocked(svc.ID, r); ok {
		return Service{}, false, &lbrule.RuleError{Class: lbrule.ErrConflict, Field: "serviceArguments.block",
			Msg: fmt.Sprintf("mode-4 rule %d (%s) already listens on %s:%d: the proxy tells rules apart by address, not by block mark; use another VIP or port",
				other.ID, other.Rule.Key(), r.Service.ExternalIP, r.Service.Port)}
	}
	c.services[svc.ID] = svc
	if err := c.reconcileLocked(ctx); err != nil {
		// Roll back to the previous table so stages and store agree again.
		if exists {
			c.services[svc.ID] = old
		} else {
			delete(c.services, svc.ID)
		}
		if rbErr := c.reconcileLocked(ctx); rbErr != nil {
			c.logger.Error("rollback reconcile failed", "err", rbErr)
		}
		return Service{}, false, err
	}
	rb, err := lbrule.Encode(r)
	if err != nil {
		return Service{}, false, err
	}
	if err := c.store.Put(store.Record{ID: svc.ID, Rule: rb, CreateBody: bytes.Clone(body), CreatedAt: svc.CreatedAt, UpdatedAt: svc.UpdatedAt}); err != nil {
		return Service{}, false, fmt.Errorf("persist rule %d: %w", svc.ID, err)
	}
	c.logger.Info("rule applied", "id", svc.ID, "key", key.String(), "mode", r.Service.Mode, "engine", r.Engine(), "update", exists)
	return svc, !exists, nil
}

func sameRule(a, b *lbrule.Rule) bool {
	x, _ := lbrule.Encode(a)
	y, _ := lbrule.Encode(b)
	return bytes.Equal(x, y)
}

// listenerTakenLocked finds another mode-4 rule on the same VIP:port (they
// differ by block mark only): the proxy has one listener per VIP:port, so
// the second could never be served.
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

func (c *Controller) findLocked(k lbrule.Key) (Service, bool) {
	for _, s := range c.services {
		if s.Rule.Key() == k {
			return s, true
		}
	}
	return Service{}, false
}

// Delete removes the rule with key k.
func (c *Controller) Delete(ctx context.Context, k lbrule.Key) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.findLocked(k)
	if !ok {
		return &lbrule.RuleError{Class: lbrule.ErrNotFound, Msg: fmt.Sprintf("lbrule not-exists error: no rule %s", k)}
	}
	return c.deleteLocked(ctx, []Service{s})
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
		c.logger.Info("rule deleted", "id", s.ID, "key", s.Rule.Key().String())
	}
	if err := c.reconcileLocked(ctx); err != nil {
		c.logger.Error("reconcile after delete", "err", err)
		return err
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
	return s, ok
}

func (c *Controller) snapshotLocked() []Service {
	out := make([]Service, 0, len(c.services))
	for _, s := range c.services {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func (c *Controller) reconcileLocked(ctx context.Context) error {
	snap := c.snapshotLocked()
	var errs []error
	for _, r := range c.recs {
		if err := r.Reconcile(ctx, snap); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Name(), err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrApply, errors.Join(errs...))
	}
	return nil
}
