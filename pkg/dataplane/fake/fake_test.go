package fake_test

import (
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/fake"
)

func TestConformance(t *testing.T) {
	dataplanetest.RunConformance(t, func(t *testing.T) dataplane.Dataplane { return fake.New() })
}
