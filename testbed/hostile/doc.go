// Package hostile attacks the real daemon process with hostile clients,
// engines, publishers and files, and checks that it survives each attack:
// the process stays alive, its resident memory stays under a stated bound,
// the attacker gets the right status, and a metric counts the rejection.
//
// Every attack runs on loopback with bounded loops and stops by itself.
package hostile
