package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// errTruncated is returned when a msgpack value runs past the end of the
// payload.
var errTruncated = errors.New("msgpack: truncated")

// maxSkipDepth bounds the nesting the skipper accepts, so a hostile payload
// cannot make one decode arbitrarily expensive.
const maxSkipDepth = 64

// mpReader is a minimal, allocation-free msgpack reader over one payload.
// The event decoders walk payloads by hand with it instead of reflecting into
// structs: one KV batch can carry thousands of block hashes and the decode
// loop is the ingestion hot path. Every read is bounds-checked; declared
// lengths are checked against the remaining bytes before anything is sized
// from them.
type mpReader struct {
	b   []byte
	off int
}

func (r *mpReader) reset(b []byte) { r.b, r.off = b, 0 }

func (r *mpReader) remaining() int { return len(r.b) - r.off }

func (r *mpReader) errAt(format string, args ...any) error {
	return fmt.Errorf("msgpack offset %d: %s", r.off, fmt.Sprintf(format, args...))
}

func (r *mpReader) peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	return r.b[r.off], nil
}

// next returns the next n bytes and advances.
func (r *mpReader) next(n int) ([]byte, error) {
	if n < 0 || n > len(r.b)-r.off {
		return nil, errTruncated
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s, nil
}

func (r *mpReader) u8() (uint8, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

func (r *mpReader) u16() (uint16, error) {
	s, err := r.next(2)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint16(s), nil
}

func (r *mpReader) u32() (uint32, error) {
	s, err := r.next(4)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(s), nil
}

func (r *mpReader) u64() (uint64, error) {
	s, err := r.next(8)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(s), nil
}

// isNil consumes a nil if one is next.
func (r *mpReader) isNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// containerLen checks that n elements (each at least minBytes long) can
// still fit in the payload.
func (r *mpReader) containerLen(n uint64, minBytes int) (int, error) {
	if n > uint64(r.remaining()/minBytes) {
		return 0, r.errAt("container of %d elements exceeds the %d remaining bytes", n, r.remaining())
	}
	return int(n), nil
}

// arrayLen reads an array header. ok is false (and nothing is consumed) when
// the next value is not an array.
func (r *mpReader) arrayLen() (n int, ok bool, err error) {
	return r.header(0x90, 0xdc, 0xdd, 1)
}

// mapLen reads a map header. ok is false (and nothing is consumed) when the
// next value is not a map.
func (r *mpReader) mapLen() (n int, ok bool, err error) {
	return r.header(0x80, 0xde, 0xdf, 2)
}

// header reads an array or map header: a fix form fix..fix+15, a 16-bit
// form c16 and a 32-bit form c32. per is the number of values an element
// takes (1 for arrays, 2 for maps), used to bound the length by the bytes
// left.
func (r *mpReader) header(fix, c16, c32 byte, per int) (n int, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	var v uint64
	switch {
	case c >= fix && c <= fix+0x0f:
		r.off++
		v = uint64(c & 0x0f)
	case c == c16:
		r.off++
		x, err := r.u16()
		if err != nil {
			return 0, true, err
		}
		v = uint64(x)
	case c == c32:
		r.off++
		x, err := r.u32()
		if err != nil {
			return 0, true, err
		}
		v = uint64(x)
	default:
		return 0, false, nil
	}
	n, err = r.containerLen(v, per)
	return n, true, err
}

// strOrBin reads a str or bin value and returns its bytes (aliasing the
// payload). ok is false (nothing consumed) for any other type.
func (r *mpReader) strOrBin() (s []byte, isBin, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return nil, false, false, err
	}
	var n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		r.off++
		n = int(c & 0x1f)
	case c == 0xd9 || c == 0xc4:
		r.off++
		x, err := r.u8()
		if err != nil {
			return nil, false, true, err
		}
		n, isBin = int(x), c == 0xc4
	case c == 0xda || c == 0xc5:
		r.off++
		x, err := r.u16()
		if err != nil {
			return nil, false, true, err
		}
		n, isBin = int(x), c == 0xc5
	case c == 0xdb || c == 0xc6:
		r.off++
		x, err := r.u32()
		if err != nil {
			return nil, false, true, err
		}
		if uint64(x) > uint64(r.remaining()) {
			return nil, false, true, errTruncated
		}
		n, isBin = int(x), c == 0xc6
	default:
		return nil, false, false, nil
	}
	s, err = r.next(n)
	return s, isBin, true, err
}

// str reads a str value.
func (r *mpReader) str() ([]byte, error) {
	s, isBin, ok, err := r.strOrBin()
	if err != nil {
		return nil, err
	}
	if !ok || isBin {
		return nil, r.errAt("expected a string")
	}
	return s, nil
}

// intKind tells whether an integer was encoded unsigned or signed.
type intKind uint8

const (
	intUnsigned intKind = iota
	intSigned
)

// integer reads any msgpack integer. Unsigned values come back as is;
// signed values come back as their two's-complement uint64 bits, with kind
// telling which. ok is false (nothing consumed) for a non-integer.
func (r *mpReader) integer() (v uint64, kind intKind, ok bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, 0, false, err
	}
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), intUnsigned, true, nil
	case c >= 0xe0:
		r.off++
		return uint64(int64(int8(c))), intSigned, true, nil
	}
	switch c {
	case 0xcc:
		r.off++
		x, err := r.u8()
		return uint64(x), intUnsigned, true, err
	case 0xcd:
		r.off++
		x, err := r.u16()
		return uint64(x), intUnsigned, true, err
	case 0xce:
		r.off++
		x, err := r.u32()
		return uint64(x), intUnsigned, true, err
	case 0xcf:
		r.off++
		x, err := r.u64()
		return x, intUnsigned, true, err
	case 0xd0:
		r.off++
		x, err := r.u8()
		return uint64(int64(int8(x))), intSigned, true, err
	case 0xd1:
		r.off++
		x, err := r.u16()
		return uint64(int64(int16(x))), intSigned, true, err
	case 0xd2:
		r.off++
		x, err := r.u32()
		return uint64(int64(int32(x))), intSigned, true, err
	case 0xd3:
		r.off++
		x, err := r.u64()
		return x, intSigned, true, err
	}
	return 0, 0, false, nil
}

// smallInt reads an integer that must fit an int64 (block sizes, ranks,
// group indexes).
func (r *mpReader) smallInt() (int64, error) {
	v, kind, ok, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, r.errAt("expected an integer")
	}
	if kind == intUnsigned && v > math.MaxInt64 {
		return 0, r.errAt("integer %d out of range", v)
	}
	return int64(v), nil
}

// float reads a float32/float64, or an integer as a float (timestamps).
func (r *mpReader) float() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case 0xca:
		r.off++
		x, err := r.u32()
		return float64(math.Float32frombits(x)), err
	case 0xcb:
		r.off++
		x, err := r.u64()
		return math.Float64frombits(x), err
	}
	v, kind, ok, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, r.errAt("expected a number")
	}
	if kind == intSigned {
		return float64(int64(v)), nil
	}
	return float64(v), nil
}

// skip consumes one value of any type. Nesting is walked iteratively with a
// pending-item counter, bounded by maxSkipDepth.
func (r *mpReader) skip() error {
	var stack [maxSkipDepth]int
	depth := 0
	pending := 1
	for {
		for pending == 0 {
			if depth == 0 {
				return nil
			}
			depth--
			pending = stack[depth]
		}
		pending--
		c, err := r.u8()
		if err != nil {
			return err
		}
		var children uint64
		var skipBytes uint64
		switch {
		case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		case c >= 0x80 && c <= 0x8f:
			children = 2 * uint64(c&0x0f)
		case c >= 0x90 && c <= 0x9f:
			children = uint64(c & 0x0f)
		case c >= 0xa0 && c <= 0xbf:
			skipBytes = uint64(c & 0x1f)
		default:
			switch c {
			case 0xc4, 0xd9:
				x, err := r.u8()
				if err != nil {
					return err
				}
				skipBytes = uint64(x)
			case 0xc5, 0xda:
				x, err := r.u16()
				if err != nil {
					return err
				}
				skipBytes = uint64(x)
			case 0xc6, 0xdb:
				x, err := r.u32()
				if err != nil {
					return err
				}
				skipBytes = uint64(x)
			case 0xc7: // ext8
				x, err := r.u8()
				if err != nil {
					return err
				}
				skipBytes = uint64(x) + 1
			case 0xc8: // ext16
				x, err := r.u16()
				if err != nil {
					return err
				}
				skipBytes = uint64(x) + 1
			case 0xc9: // ext32
				x, err := r.u32()
				if err != nil {
					return err
				}
				skipBytes = uint64(x) + 1
			case 0xcc, 0xd0:
				skipBytes = 1
			case 0xcd, 0xd1:
				skipBytes = 2
			case 0xca, 0xce, 0xd2:
				skipBytes = 4
			case 0xcb, 0xcf, 0xd3:
				skipBytes = 8
			case 0xd4:
				skipBytes = 2
			case 0xd5:
				skipBytes = 3
			case 0xd6:
				skipBytes = 5
			case 0xd7:
				skipBytes = 9
			case 0xd8:
				skipBytes = 17
			case 0xdc:
				x, err := r.u16()
				if err != nil {
					return err
				}
				children = uint64(x)
			case 0xdd:
				x, err := r.u32()
				if err != nil {
					return err
				}
				children = uint64(x)
			case 0xde:
				x, err := r.u16()
				if err != nil {
					return err
				}
				children = 2 * uint64(x)
			case 0xdf:
				x, err := r.u32()
				if err != nil {
					return err
				}
				children = 2 * uint64(x)
			default: // 0xc1 is never used
				return r.errAt("invalid msgpack type byte 0x%02x", c)
			}
		}
		if skipBytes > 0 {
			if skipBytes > uint64(r.remaining()) {
				return errTruncated
			}
			r.off += int(skipBytes)
		}
		if children > 0 {
			if children > uint64(r.remaining()) {
				return errTruncated
			}
			if depth == maxSkipDepth {
				return r.errAt("nesting deeper than %d", maxSkipDepth)
			}
			stack[depth] = pending
			depth++
			pending = int(children)
		}
	}
}
