package cache

import (
	"container/list"
	"sync"
	"time"
)

// Entry is one cached value and the time it stops being fresh.
type Entry struct {
	Key     string
	Value   []byte
	Expires time.Time
}

// LRU keeps at most Capacity entries, the least recently used dropped first.
type LRU struct {
	mu       sync.Mutex
	Capacity int
	TTL      time.Duration
	order    *list.List
	items    map[string]*list.Element
	hits     int
	misses   int
}

// New returns an empty cache of the given capacity and time to live.
func New(capacity int, ttl time.Duration) *LRU {
	return &LRU{
		Capacity: capacity,
		TTL:      ttl,
		order:    list.New(),
		items:    make(map[string]*list.Element),
	}
}

// Get returns the value under key, if it is there and still fresh.
func (c *LRU) Get(key string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	element, ok := c.items[key]
	if !ok {
		c.misses++
		return nil, false
	}
	entry := element.Value.(*Entry)
	if time.Now().After(entry.Expires) {
		c.order.Remove(element)
		delete(c.items, key)
		c.misses++
		return nil, false
	}
	c.order.MoveToFront(element)
	c.hits++
	return entry.Value, true
}

// Put stores value under key, replacing what was there.
func (c *LRU) Put(key string, value []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if element, ok := c.items[key]; ok {
		entry := element.Value.(*Entry)
		entry.Value = value
		entry.Expires = time.Now().Add(c.TTL)
		c.order.MoveToFront(element)
		return
	}
	entry := &Entry{Key: key, Value: value, Expires: time.Now().Add(c.TTL)}
	c.items[key] = c.order.PushFront(entry)
	for c.order.Len() > c.Capacity {
		oldest := c.order.Back()
		c.order.Remove(oldest)
		delete(c.items, oldest.Value.(*Entry).Key)
	}
}

// Stats returns the hits and misses counted so far.
func (c *LRU) Stats() (int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hits, c.misses
}
