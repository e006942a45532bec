package etcdtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// TLSFiles are PEM files of a test CA, etcd's server certificate (for
// 127.0.0.1) and a client certificate, all signed by that CA.
type TLSFiles struct {
	CA, ServerCert, ServerKey, ClientCert, ClientKey string
	// OtherCA is a CA that signed none of them.
	OtherCA string
}

func writeTLSFiles(dir string) (*TLSFiles, error) {
	f := &TLSFiles{CA: filepath.Join(dir, "ca.pem"), ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server.key"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client.key"), OtherCA: filepath.Join(dir, "other-ca.pem")}
	ca, caKey, err := newCert("etcd test CA", nil, nil, true, 1)
	if err != nil {
		return nil, err
	}
	other, _, err := newCert("unrelated CA", nil, nil, true, 2)
	if err != nil {
		return nil, err
	}
	srv, srvKey, err := newCert("etcd", ca, caKey, false, 3)
	if err != nil {
		return nil, err
	}
	cli, cliKey, err := newCert("loxilb", ca, caKey, false, 4)
	if err != nil {
		return nil, err
	}
	srvDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		return nil, err
	}
	cliDER, err := x509.MarshalECPrivateKey(cliKey)
	if err != nil {
		return nil, err
	}
	for _, w := range []struct {
		path string
		typ  string
		der  []byte
	}{{f.CA, "CERTIFICATE", ca.Raw}, {f.OtherCA, "CERTIFICATE", other.Raw}, {f.ServerCert, "CERTIFICATE", srv.Raw},
		{f.ClientCert, "CERTIFICATE", cli.Raw}, {f.ServerKey, "EC PRIVATE KEY", srvDER}, {f.ClientKey, "EC PRIVATE KEY", cliDER}} {
		if err := os.WriteFile(w.path, pem.EncodeToMemory(&pem.Block{Type: w.typ, Bytes: w.der}), 0o600); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// newCert makes a certificate signed by parent (self-signed when nil) and
// returns it with its private key.
func newCert(cn string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, isCA bool, serial int64) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"}}
	if isCA {
		tmpl.IsCA, tmpl.BasicConstraintsValid, tmpl.KeyUsage = true, true, x509.KeyUsageCertSign|x509.KeyUsageDigitalSignature
		tmpl.ExtKeyUsage, tmpl.IPAddresses, tmpl.DNSNames = nil, nil, nil
	}
	signer, signKey := tmpl, key
	if parent != nil {
		signer, signKey = parent, parentKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signKey)
	if err != nil {
		return nil, nil, err
	}
	c, err := x509.ParseCertificate(der)
	return c, key, err
}
