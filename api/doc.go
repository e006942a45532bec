// Package api is the management plane: a gin REST server under /netlox/v1
// (loxilb-compatible paths and bodies), its wire types, the OpenAPI document
// of the whole API, and the one function that maps errors to HTTP statuses.
// It is the only package that imports gin.
//
// In: HTTP requests from curl, loxicmd (through api/client) and scrapers.
// Out: calls into control (rules), and read-only views of capabilities, KV
// inventories and metrics supplied by the daemon as small interfaces.
package api
