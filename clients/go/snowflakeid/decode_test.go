package snowflakeid

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// The ids the server's own generator made, shared by every language's decoder
// (written by clients/testdata/make_vectors.py).
var vectorsFile = filepath.Join("..", "..", "testdata", "decode-vectors.json")

type vectors struct {
	Layouts map[string]Layout `json:"layouts"`
	Valid   []struct {
		Layout       string `json:"layout"`
		Note         string `json:"note"`
		ID           string `json:"id"`
		Time         string `json:"time"`
		TimestampMs  int64  `json:"timestamp_ms"`
		DatacenterID int64  `json:"datacenter_id"`
		WorkerID     int64  `json:"worker_id"`
		Sequence     int64  `json:"sequence"`
	} `json:"valid"`
	Invalid []struct {
		Layout string `json:"layout"`
		Input  string `json:"input"`
		Error  string `json:"error"`
		Note   string `json:"note"`
	} `json:"invalid"`
}

func load(t *testing.T) vectors {
	t.Helper()
	data, err := os.ReadFile(vectorsFile)
	if err != nil {
		t.Fatal(err)
	}
	var v vectors
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.Valid) == 0 || len(v.Invalid) == 0 || len(v.Layouts) == 0 {
		t.Fatalf("%s has no vectors", vectorsFile)
	}
	return v
}

const isoMs = "2006-01-02T15:04:05.000Z07:00"

func TestValidVectors(t *testing.T) {
	v := load(t)
	for _, want := range v.Valid {
		layout, ok := v.Layouts[want.Layout]
		if !ok {
			t.Fatalf("no layout %q", want.Layout)
		}
		where := fmt.Sprintf("%s: %s (%s)", want.Layout, want.ID, want.Note)
		got, err := DecodeString(want.ID, layout)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		if fmt.Sprint(got.ID) != want.ID || got.TimestampMs != want.TimestampMs ||
			got.DatacenterID != want.DatacenterID || got.WorkerID != want.WorkerID ||
			got.Sequence != want.Sequence {
			t.Errorf("%s: got %+v", where, got)
		}
		if iso := got.Time.Format(isoMs); iso != want.Time {
			t.Errorf("%s: time %s, want %s", where, iso, want.Time)
		}
		again, err := Decode(got.ID, layout)
		if err != nil || again != got {
			t.Errorf("%s: Decode gives %+v, %v", where, again, err)
		}
		id, err := Compose(got.TimestampMs, got.DatacenterID, got.WorkerID, got.Sequence, layout)
		if err != nil || id != got.ID {
			t.Errorf("%s: Compose gives %d, %v", where, id, err)
		}
	}
	// Read by tests/client/test_decode_vectors.py: every vector was checked.
	t.Logf("decode vectors: %d valid checked", len(v.Valid))
}

func TestInvalidVectors(t *testing.T) {
	v := load(t)
	kinds := map[string]error{"format": ErrFormat, "range": ErrRange}
	for _, bad := range v.Invalid {
		kind, ok := kinds[bad.Error]
		if !ok {
			t.Fatalf("unknown error kind %q", bad.Error)
		}
		_, err := DecodeString(bad.Input, v.Layouts[bad.Layout])
		if !errors.Is(err, kind) {
			t.Errorf("%s: %q (%s): got %v, want %v", bad.Layout, bad.Input, bad.Note, err, kind)
		}
	}
	t.Logf("decode vectors: %d invalid checked", len(v.Invalid))
}

func TestTheDefaultLayoutIsTheVectorsDefault(t *testing.T) {
	if v := load(t); v.Layouts["default"] != DefaultLayout {
		t.Fatalf("DefaultLayout %+v, the vectors' %+v", DefaultLayout, v.Layouts["default"])
	}
}

func TestTextThatStrconvWouldTakeIsRefused(t *testing.T) {
	for _, s := range []string{"+1", " 1", "1 ", "1_000", "0x1F", "-", "\u0663"} {
		if _, err := DecodeString(s, DefaultLayout); !errors.Is(err, ErrFormat) {
			t.Errorf("%q: got %v, want ErrFormat", s, err)
		}
	}
	if p, err := DecodeString("007", DefaultLayout); err != nil || p.ID != 7 {
		t.Errorf(`"007": %+v, %v`, p, err)
	}
}

func TestInvalidLayouts(t *testing.T) {
	for _, l := range []Layout{
		{},
		{EpochMs: 0, TimestampBits: 41, DatacenterIDBits: 5, WorkerIDBits: 5, SequenceBits: 13},
		{EpochMs: -1, TimestampBits: 41, DatacenterIDBits: 5, WorkerIDBits: 5, SequenceBits: 12},
		{EpochMs: 0, TimestampBits: 41, DatacenterIDBits: -1, WorkerIDBits: 5, SequenceBits: 12},
		{EpochMs: 0, TimestampBits: 41, DatacenterIDBits: 5, WorkerIDBits: 5, SequenceBits: 0},
	} {
		if _, err := Decode(0, l); !errors.Is(err, ErrLayout) {
			t.Errorf("%+v: Decode gives %v, want ErrLayout", l, err)
		}
		if _, err := Compose(0, 0, 0, 0, l); !errors.Is(err, ErrLayout) {
			t.Errorf("%+v: Compose gives %v, want ErrLayout", l, err)
		}
	}
}

func TestATimestampPastInt64IsOutOfRange(t *testing.T) {
	late := Layout{EpochMs: math.MaxInt64 - 1, TimestampBits: 62, SequenceBits: 1}
	if p, err := Decode(2, late); err != nil || p.TimestampMs != math.MaxInt64 {
		t.Fatalf("the last ms: %+v, %v", p, err)
	}
	if _, err := Decode(4, late); !errors.Is(err, ErrRange) {
		t.Fatalf("got %v, want ErrRange", err)
	}
}

func TestComposeRefusesPartsThatDoNotFit(t *testing.T) {
	cases := [][4]int64{
		{1288834974656, 0, 0, 0},  // before the epoch
		{3487858230209, 0, 0, 0},  // after the layout's last ms
		{1505914988849, 32, 0, 0}, // datacenter
		{1505914988849, 0, -1, 0}, // worker
		{1505914988849, 0, 0, 4096},
	}
	for _, c := range cases {
		if id, err := Compose(c[0], c[1], c[2], c[3], DefaultLayout); !errors.Is(err, ErrRange) {
			t.Errorf("%v: got %d, %v; want ErrRange", c, id, err)
		}
	}
}

func ExampleDecodeString() {
	parts, err := DecodeString("910499571847892992", DefaultLayout)
	if err != nil {
		panic(err)
	}
	fmt.Println(parts.Time.Format(isoMs), parts.DatacenterID, parts.WorkerID, parts.Sequence)
	// Output: 2017-09-20T13:43:08.849Z 17 25 0
}

func ExampleCompose() {
	id, err := Compose(1505914988849, 17, 25, 0, DefaultLayout)
	fmt.Println(id, err)
	// Output: 910499571847892992 <nil>
}
