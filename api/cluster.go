package api

import (
	"fmt"
	"net/http"

	"github.com/gin-gonic/gin"
)

// ClusterPath lists the gateway nodes sharing the rule store and the
// settings on which they drift.
const ClusterPath = "/cluster"

// cluster answers GET /cluster (a cluster.View). The status is 200 whatever the drift; View.Drifted tells a caller
// (loxicmd exits non-zero on it) that settings differ between nodes.
func (s *Server) cluster(c *gin.Context) {
	if s.deps.Cluster == nil {
		s.fail(c, fmt.Errorf("%w: cluster membership is not wired in this server", errUnavailable))
		return
	}
	c.JSON(http.StatusOK, s.deps.Cluster())
}
