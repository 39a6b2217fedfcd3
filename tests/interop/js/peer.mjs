// A real third-party libp2p peer for peertrain's interop test (tests/test_interop_js.py).
//
// usage: node --import ./polyfill.mjs peer.mjs <node multiaddr> <node peer id> <run-id>
//
// Steps, each with its own deadline, each printing one JSON line
// {"step": ..., "ok": true|false, "ms": ..., ...}:
//   connect  dial the node (TCP + Noise + Yamux) and wait for identify; lists its protocols
//   ping     /ipfs/ping/1.0.0
//   dht-get  GET_VALUE /ptpeer/<node peer id> over peertrain's DHT (/peertrain/kad/1.0.0);
//            prints the value as hex for the python side to verify
//   gossip   one message on /peertrain/<run-id>/hb/1 from the node; prints data as hex
// Exits 0 when every step passed, 1 when one failed, 2 on bad usage. The libp2p node is
// always stopped, and a watchdog ends the process if anything hangs.
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { kadDHT, passthroughMapper } from '@libp2p/kad-dht'
import { gossipsub } from '@libp2p/gossipsub'
import { multiaddr } from '@multiformats/multiaddr'

const say = (doc) => console.log(JSON.stringify(doc))
const hex = (bytes) => Buffer.from(bytes).toString('hex')
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

const [addr, peerId, runId] = process.argv.slice(2)
if (!addr || !peerId || !runId) {
  console.error('usage: node --import ./polyfill.mjs peer.mjs <node multiaddr> <node peer id> <run-id>')
  process.exit(2)
}

const WATCHDOG_MS = 55000 // past the sum of the deadlines below (10+5+15+15 s, 5 s to stop)
setTimeout(() => {
  say({ step: 'watchdog', ok: false, error: `still running after ${WATCHDOG_MS} ms, exiting` })
  process.exit(3)
}, WATCHDOG_MS).unref()

// Fails after `ms`; `fn` gets an AbortSignal that fires then, to cancel what it started.
async function withDeadline (ms, what, fn) {
  const controller = new AbortController()
  let timer
  const expired = new Promise((_resolve, reject) => {
    timer = setTimeout(() => {
      controller.abort()
      reject(new Error(`${what}: timed out after ${ms} ms`))
    }, ms)
  })
  try {
    return await Promise.race([fn(controller.signal), expired])
  } finally {
    clearTimeout(timer)
  }
}

let failed = false
async function step (name, ms, fn) {
  const start = Date.now()
  try {
    const result = await withDeadline(ms, name, fn)
    say({ step: name, ok: true, ms: Date.now() - start, ...result })
    return true
  } catch (e) {
    failed = true
    say({ step: name, ok: false, ms: Date.now() - start, error: String(e?.message ?? e) })
    return false
  }
}

let node
try {
  node = await createLibp2p({
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    services: {
      identify: identify(),
      // js ping allows one outbound stream per connection by default. kad-dht pings a peer
      // before adding it to its routing table; if our own ping holds that one stream, the
      // DHT's ping fails with TooManyOutboundProtocolStreamsError, the node never enters
      // the routing table and every DHT query waits forever for peers.
      ping: ping({ maxOutboundStreams: 4 }),
      dht: kadDHT({
        protocol: '/peertrain/kad/1.0.0', // peertrain's own DHT, not the public IPFS one
        clientMode: false,
        peerInfoMapper: passthroughMapper, // keep loopback peers in the routing table
        validators: { ptpeer: async () => {} }, // the python side verifies the signature
        selectors: { ptpeer: () => 0 }
      }),
      pubsub: gossipsub({ allowPublishToZeroTopicPeers: true })
    }
  })
} catch (e) {
  say({ step: 'start', ok: false, error: String(e?.stack ?? e) })
  process.exit(1)
}

try {
  const topic = `/peertrain/${runId}/hb/1`
  let subscribedAt
  const gossip = new Promise((resolve) => {
    node.services.pubsub.addEventListener('message', (evt) => {
      const m = evt.detail
      if (m.topic === topic && m.from?.toString() === peerId) {
        resolve({ topic, from: m.from.toString(), data: hex(m.data), after_subscribe_ms: Date.now() - subscribedAt })
      }
    })
  })
  const identified = new Promise((resolve) => {
    node.addEventListener('peer:identify', (evt) => {
      if (evt.detail.peerId.toString() === peerId) resolve(evt.detail)
    })
  })
  node.services.pubsub.subscribe(topic)
  subscribedAt = Date.now()

  const connected = await step('connect', 10000, async () => {
    const conn = await node.dial(multiaddr(addr))
    const id = await identified
    return {
      remote: conn.remotePeer.toString(),
      encryption: conn.encryption,
      muxer: conn.multiplexer,
      agent: id.agentVersion,
      protocols: [...id.protocols].sort()
    }
  })
  if (connected) {
    await step('ping', 5000, async (signal) => {
      for (let attempt = 1; ; attempt++) {
        try {
          return { rtt_ms: await node.services.ping.ping(multiaddr(addr), { signal }), attempt }
        } catch (e) {
          // Only one outbound ping stream can be open per peer; another may hold it briefly.
          if (attempt >= 5 || e?.name !== 'TooManyOutboundProtocolStreamsError') throw e
          await sleep(200)
        }
      }
    })
    await step('dht-get', 15000, async (signal) => {
      const key = `/ptpeer/${peerId}`
      let attempts = 0
      let last = 'no answer'
      const giveUp = Date.now() + 12000 // then report the attempts, before the step deadline
      for (let attempt = 1; Date.now() < giveUp; attempt++) {
        // Each query has its own short deadline: a new node may not have put its record yet.
        const attemptSignal = AbortSignal.any([signal, AbortSignal.timeout(3000)])
        try {
          for await (const event of node.services.dht.get(new TextEncoder().encode(key), { signal: attemptSignal })) {
            if (event.name === 'VALUE') {
              return { key, value: hex(event.value), from: event.from?.toString(), attempt }
            }
          }
          last = 'the query finished without a value'
        } catch (e) {
          last = `${e?.name ?? 'Error'}: ${e?.message ?? e}`
        }
        attempts = attempt
        await sleep(500)
      }
      throw new Error(`no value for ${key} after ${attempts} attempts (last: ${last})`)
    })
    await step('gossip', 15000, async () => await gossip)
  }
} catch (e) {
  failed = true
  say({ step: 'internal', ok: false, error: String(e?.stack ?? e) })
} finally {
  try {
    await withDeadline(5000, 'stop', async () => await node.stop())
  } catch (e) {
    say({ step: 'stop', ok: false, error: String(e?.message ?? e) })
  }
}
process.exit(failed ? 1 : 0)
