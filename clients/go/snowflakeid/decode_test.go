package snowflakeid

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
		// A pointer: a vector without the field is a stale file, not a clock sequence 0.
		ClockSequence *int64 `json:"clock_sequence"`
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
	withClockSequence := 0
	for _, want := range v.Valid {
		layout, ok := v.Layouts[want.Layout]
		if !ok {
			t.Fatalf("no layout %q", want.Layout)
		}
		where := fmt.Sprintf("%s: %s (%s)", want.Layout, want.ID, want.Note)
		if want.ClockSequence == nil {
			t.Fatalf("%s: no clock_sequence", where)
		}
		if *want.ClockSequence != 0 {
			withClockSequence++
		}
		got, err := DecodeString(want.ID, layout)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		if fmt.Sprint(got.ID) != want.ID || got.TimestampMs != want.TimestampMs ||
			got.DatacenterID != want.DatacenterID || got.WorkerID != want.WorkerID ||
			got.Sequence != want.Sequence || got.ClockSequence != *want.ClockSequence {
			t.Errorf("%s: got %+v", where, got)
		}
		if iso := got.Time.Format(isoMs); iso != want.Time {
			t.Errorf("%s: time %s, want %s", where, iso, want.Time)
		}
		again, err := Decode(got.ID, layout)
		if err != nil || again != got {
			t.Errorf("%s: Decode gives %+v, %v", where, again, err)
		}
		id, err := ComposeWithClockSequence(
			got.TimestampMs, got.DatacenterID, got.WorkerID, got.Sequence, got.ClockSequence, layout)
		if err != nil || id != got.ID {
			t.Errorf("%s: ComposeWithClockSequence gives %d, %v", where, id, err)
		}
		// Compose is the same at clock sequence 0: the id with that field cleared.
		id, err = Compose(got.TimestampMs, got.DatacenterID, got.WorkerID, got.Sequence, layout)
		atZero := got.ID &^ (mask(layout.ClockSequenceBits) << layout.clockSequenceShift())
		if err != nil || id != atZero {
			t.Errorf("%s: Compose gives %d, %v; want %d", where, id, err, atZero)
		}
	}
	// Else the clock-sequence field would be checked only at 0.
	if withClockSequence == 0 {
		t.Errorf("no vector has a clock sequence")
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
		{EpochMs: 0, TimestampBits: 41, DatacenterIDBits: 5, WorkerIDBits: 5, SequenceBits: 12, ClockSequenceBits: -1},
		{EpochMs: 0, TimestampBits: 1, SequenceBits: 1, ClockSequenceBits: 64},
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

// The vectors' layout of two clock-sequence bits: Twitter's, with 3 bits of datacenter.
var withClockSequence = Layout{
	EpochMs: 1288834974657, TimestampBits: 41, DatacenterIDBits: 3, WorkerIDBits: 5,
	SequenceBits: 12, ClockSequenceBits: 2,
}

func TestTheClockSequenceSitsBetweenTheTimestampAndTheDatacenterID(t *testing.T) {
	// Each field alone, at its own shift: clock sequence at 12 + 5 + 3 = 20, timestamp at 22.
	cases := []struct {
		id   int64
		want Parts
	}{
		{3 << 20, Parts{TimestampMs: 1288834974657, ClockSequence: 3}},
		{1 << 22, Parts{TimestampMs: 1288834974658}},
		{7 << 17, Parts{TimestampMs: 1288834974657, DatacenterID: 7}},
		{910499571848417281, Parts{TimestampMs: 1505914988849, DatacenterID: 5, WorkerID: 25,
			Sequence: 1, ClockSequence: 2}},
	}
	for _, c := range cases {
		c.want.ID, c.want.Time = c.id, time.UnixMilli(c.want.TimestampMs).UTC()
		if got, err := Decode(c.id, withClockSequence); err != nil || got != c.want {
			t.Errorf("%d: got %+v, %v; want %+v", c.id, got, err, c.want)
		}
		w := c.want
		id, err := ComposeWithClockSequence(w.TimestampMs, w.DatacenterID, w.WorkerID, w.Sequence,
			w.ClockSequence, withClockSequence)
		if err != nil || id != c.id {
			t.Errorf("%+v: ComposeWithClockSequence gives %d, %v; want %d", w, id, err, c.id)
		}
	}
	// A layout without one: every id's clock sequence is 0.
	if p, err := Decode(math.MaxInt64, DefaultLayout); err != nil || p.ClockSequence != 0 {
		t.Errorf("the default layout's last id: %+v, %v", p, err)
	}
}

func TestComposeRefusesAClockSequenceThatDoesNotFit(t *testing.T) {
	for _, c := range []struct {
		clockSequence int64
		layout        Layout
	}{
		{4, withClockSequence},
		{-1, withClockSequence},
		{math.MaxInt64, withClockSequence},
		{1, DefaultLayout}, // a layout without one: only 0 fits
	} {
		id, err := ComposeWithClockSequence(1505914988849, 5, 25, 0, c.clockSequence, c.layout)
		if !errors.Is(err, ErrRange) {
			t.Errorf("clock sequence %d in %+v: got %d, %v; want ErrRange", c.clockSequence, c.layout, id, err)
		}
	}
	_, err := ComposeWithClockSequence(1505914988849, 5, 25, 0, 4, withClockSequence)
	if want := "clock sequence must be in 0..3, got 4"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("got %v, want it to say %q", err, want)
	}
}

func TestAClockSequenceCountsTowardTheLayoutsBits(t *testing.T) {
	// Twitter's layout uses all 63 bits: a clock sequence must take its bits from the node id.
	tooWide := DefaultLayout
	tooWide.ClockSequenceBits = 2
	err := tooWide.Validate()
	if !errors.Is(err, ErrLayout) {
		t.Fatalf("%+v: got %v, want ErrLayout", tooWide, err)
	}
	for _, want := range []string{"needs 65 bits", "clock_sequence_bits 2", "fewer datacenter_id_bits"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
	if _, err := Decode(0, tooWide); !errors.Is(err, ErrLayout) {
		t.Errorf("Decode: got %v, want ErrLayout", err)
	}
	if _, err := ComposeWithClockSequence(1505914988849, 0, 0, 0, 0, tooWide); !errors.Is(err, ErrLayout) {
		t.Errorf("ComposeWithClockSequence: got %v, want ErrLayout", err)
	}
	// Without the hint when the clock sequence is not to blame.
	err = Layout{TimestampBits: 41, DatacenterIDBits: 5, WorkerIDBits: 5, SequenceBits: 13}.Validate()
	if err == nil || strings.Contains(err.Error(), "clock") {
		t.Errorf("got %v, want no word of a clock sequence", err)
	}
	if err := withClockSequence.Validate(); err != nil {
		t.Errorf("%+v: %v", withClockSequence, err)
	}
}

func TestLayoutJSONWithoutAClockSequenceHasNone(t *testing.T) {
	// What GET /v1/layout answers on a server from before clock sequences.
	var l Layout
	old := `{"epoch_ms": 1288834974657, "timestamp_bits": 41, "datacenter_id_bits": 5,
		"worker_id_bits": 5, "sequence_bits": 12, "datacenter_id": 0, "worker_id": 0}`
	if err := json.Unmarshal([]byte(old), &l); err != nil || l != DefaultLayout {
		t.Errorf("got %+v, %v; want DefaultLayout", l, err)
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

func ExampleComposeWithClockSequence() {
	// A server run with --clock-sequence-bits 2 --datacenter-id-bits 3, at clock sequence 2.
	layout := DefaultLayout
	layout.DatacenterIDBits, layout.ClockSequenceBits = 3, 2
	id, err := ComposeWithClockSequence(1505914988849, 5, 25, 0, 2, layout)
	fmt.Println(id, err)
	parts, _ := Decode(id, layout)
	fmt.Println(parts.ClockSequence, parts.DatacenterID)
	// Output:
	// 910499571848417280 <nil>
	// 2 5
}
